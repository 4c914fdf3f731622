"""The peers some tests run against: installed only by ``.ci/run``'s second step.

The README's test command runs on what ``pip install -e '.[dev]'`` installs, which holds
none of these. A test that runs one says so with ``@pytest.mark.peer("deepspeed")``
(the module it imports): without it the test skips with the peer's name and how to
install it (``tests/conftest.py``), and ``pytest -m peer`` is the step that runs them all
with the peers installed. A test that skips for want of a peer without carrying the mark
fails instead, since that step would never select it.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    """One peer: the distribution a user installs, the version its tests (and
    recordings) were made with, and how to install it on a CPU machine."""

    distribution: str
    version: str
    install: str


# Keyed by the module a test imports. The install lines are .ci/run's peer step's.
PEERS = {
    "deepspeed": Peer("DeepSpeed", "0.19.8",
                      "pip install ninja hjson py-cpuinfo pydantic tqdm psutil msgpack "
                      "packaging && DS_BUILD_OPS=0 pip install --no-build-isolation "
                      "--no-deps deepspeed==0.19.8"),
    "megatron.core": Peer("megatron-core", "0.16.1",
                          "pip install packaging && pip install --no-deps "
                          "megatron-core==0.16.1"),
}


def installed(module: str) -> bool:
    """Whether ``module`` (dotted or not) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def missing(module: str) -> str | None:
    """Why a test marked ``peer(module)`` cannot run here (a skip reason naming the peer and
    its install line), or None when the peer is installed."""
    if module not in PEERS:
        raise ValueError(f"peer({module!r}): not one of tests.helpers.peers.PEERS "
                         f"({', '.join(PEERS)})")
    if installed(module):
        return None
    peer = PEERS[module]
    return (f"peer test: {peer.distribution} {peer.version} is not installed "
            f"({peer.install}; .ci/run's peer step does it)")


def named_in(text: str) -> str | None:
    """The peer a skip or import error message is about ("No module named 'deepspeed'",
    pytest.importorskip's "could not import 'deepspeed'"), or None."""
    quoted = {name.split(".")[0] for name in re.findall(r"'([\w.]+)'", text)}
    return next((module for module in PEERS if module.split(".")[0] in quoted), None)
