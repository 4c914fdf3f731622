"""The recording in ``tests/hybrid_deepspeed/recorded/`` is reproducible: the recorder, rerun
under the live DeepSpeed for one case, writes the same record as the committed file (its
numbers within CROSS_CPU on another machine than the one that made it).
Skips, saying why, where DeepSpeed is not installed or is not the version recorded."""

from __future__ import annotations

import json

import pytest

from tests.hybrid_deepspeed.record_deepspeed import RECORDED, record, versions

# a cheap case that still takes ZeRO's partitioned path: stage 2, four steps; and the
# one with parameters the loss does not reach (DeepSpeed's ignore_unused_parameters)
CASES = ["zero2", "unused_parameters"]


@pytest.mark.peer("deepspeed")
@pytest.mark.parametrize("case", CASES)
def test_the_recorder_reproduces_the_committed_numbers(tmp_path, case):
    with open(RECORDED / f"{case}.json") as f:
        committed = json.load(f)
    installed = versions()
    if installed["deepspeed"] != committed["versions"]["deepspeed"]:
        pytest.skip(f"DeepSpeed {installed['deepspeed']} is installed, the recording is "
                    f"{committed['versions']['deepspeed']}'s")
    rerun = record([case], tmp_path, timeout=300)[case]
    # the same record, its numbers within CROSS_CPU of the committed ones (exact on the
    # machine that made it: [Note: recordings and the CPU] in test_deepspeed_examples.py);
    # transformers' version is the one installed, not a number of the run
    _same(rerun, committed, case)


CROSS_CPU = 1e-3


def _same(got, want, where: str) -> None:
    """``got`` is ``want`` with each float within CROSS_CPU (relative); versions but
    transformers' equal."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            if where.endswith("versions") and k == "transformers":
                continue
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(want, float):
        assert abs(got - want) <= CROSS_CPU * abs(want), (where, got, want)
    else:
        assert got == want, (where, got, want)
