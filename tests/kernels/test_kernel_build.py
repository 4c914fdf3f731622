"""A kernel build says when it starts and ends, waits for a live builder by name, and takes
over from one that was killed mid-way (hybrid/kernels/build.py, "one builder, and a build
killed mid-way").

The extension built here is a tiny C module (no torch headers: a second to compile) through
the same path as hybrid's kernels: ``build._build``, cpp_extension, the cache directory.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hybrid.config.sections import KernelConfig
from hybrid.kernels import build, settings

TINY = """
#include <Python.h>
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "NAME", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&tiny); }
"""
NAME = "hybrid_tiny_ext"


@pytest.fixture
def tiny(tmp_path, request):
    """(source path, cache dir, module name) with the kernel settings pointing at that
    cache. The module is named for the test: cpp_extension versions a name it has built in
    another directory of the same process (``_v1``), which a fixed ``PyInit_`` would not
    match."""
    name = f"{NAME}_{len(request.node.name)}"
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY.replace("NAME", name))
    before = settings.current()
    settings.configure(KernelConfig(cache_dir=str(tmp_path / "cache")))
    yield src, tmp_path / "cache", name
    settings.configure(before)


def _build(src, name):
    return build._build(name, [src], False, [], [], [])


def test_a_build_says_when_it_starts_and_ends_and_a_cached_one_says_nothing(tiny, caplog):
    src, cache, name = tiny
    with caplog.at_level(logging.INFO, logger="hybrid"):
        assert _build(src, name).__name__ == name
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith(f"hybrid: building kernel {name} in {cache}"), said
    assert said[1].startswith(f"hybrid: built kernel {name} in ") and said[1].endswith(" s")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hybrid"):
        _build(src, name)
    assert caplog.records == []


def test_a_build_killed_mid_way_is_taken_over_and_named(tiny, tmp_path, caplog):
    """A real build, killed while its compiler runs (a CXX that sleeps), leaves
    cpp_extension's baton behind; the next build takes it over, says whose it was, and
    builds. Without the take-over cpp_extension waits on that file forever."""
    src, cache, name = tiny
    stalled = tmp_path / "cxx"
    stalled.write_text("#!/bin/sh\nsleep 120\n")
    stalled.chmod(0o755)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            from pathlib import Path
            from hybrid.config.sections import KernelConfig
            from hybrid.kernels import build, settings
            settings.configure(KernelConfig(cache_dir={str(cache)!r}))
            build._build({name!r}, [Path({str(src)!r})], False, [], [], [])
        """)], env={**os.environ, "CXX": str(stalled)}, start_new_session=True)
    build_dir = build.build_dir_of(name, [src], False, [], [], [])
    deadline = time.monotonic() + 60
    while not (build_dir / build.BATON).exists():
        assert child.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)  # the builder and its stalled compiler
    child.wait()
    assert (build_dir / build.BATON).exists()  # what a kill leaves
    with caplog.at_level(logging.INFO, logger="hybrid"):
        assert _build(src, name).__name__ == name
    said = [r.getMessage() for r in caplog.records]
    assert f"{build_dir / build.BATON} was left by a build that did not finish (pid " \
           f"{child.pid} on " in said[0], said
    assert not (build_dir / build.BATON).exists()


def test_a_live_builder_is_waited_on_by_its_pid(tmp_path, caplog):
    got = threading.Event()

    def second():
        with build.build_lock(tmp_path, NAME, poll_s=0.01):
            got.set()

    with caplog.at_level(logging.INFO, logger="hybrid"):
        with build.build_lock(tmp_path, NAME):
            waiter = threading.Thread(target=second)
            waiter.start()
            deadline = time.monotonic() + 10
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not got.is_set()  # held: the second waits
        waiter.join(10)
    assert got.is_set()
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"hybrid: waiting for pid {os.getpid()} on {os.uname().nodename}, which "
                    f"builds kernel {NAME} (lock {tmp_path / build.LOCK})"], said
