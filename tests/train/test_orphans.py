"""A worker ends with its launcher (hybrid/train/orphans.py), on plain processes: the
launched case end to end (kill -9 of pretrain_gpt.sh's launcher) is in
tests/scripts/test_launch.py."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hybrid.train.orphans import LAUNCHER_PID, end_with_launcher
from tests.helpers.launch import alive, env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal is Linux's")

# A worker: arm, say so, then live until killed.
WORKER = ("import os, sys, time; from hybrid.train.orphans import end_with_launcher; "
          "print(end_with_launcher(os.environ), flush=True); time.sleep(float(sys.argv[1]))")


def test_a_process_not_started_by_a_launcher_is_left_alone():
    """A script run by hand (or under nohup) must outlive its shell: nothing is armed."""
    assert end_with_launcher({}) is False


@pytest.mark.parametrize("launcher,armed", [("parent", "True"), ("1", None)])
def test_a_launcher_that_died_before_the_arming_ends_the_worker_at_once(launcher, armed):
    """The race: a parent other than the launcher named means the launcher is gone, and
    the worker is killed by the signal it would have got; its own launcher lets it run."""
    pid = str(os.getpid()) if launcher == "parent" else launcher
    r = subprocess.run([sys.executable, "-c", WORKER, "0"], capture_output=True, check=False,
                       text=True, env=dict(env(), **{LAUNCHER_PID: pid}), timeout=60)
    if armed:
        assert (r.returncode, r.stdout.strip()) == (0, armed), r.stderr
    else:
        assert (r.returncode, r.stdout) == (-signal.SIGKILL, ""), r.stderr


def test_the_worker_dies_with_its_launcher():
    """A launcher (here a plain Python process) starts a worker and is SIGKILLed: the
    kernel kills the worker too, though nothing ran in the launcher on its way out."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys; "
         f"os.environ[{LAUNCHER_PID!r}] = str(os.getpid()); "
         f"subprocess.run([sys.executable, '-c', {WORKER!r}, '60'])"],
        env=env(), stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        assert launcher.stdout.readline().strip() == "True"  # the worker armed
        worker = int(subprocess.run(["ps", "-o", "pid=", "--ppid", str(launcher.pid)],
                                    capture_output=True, check=False, text=True).stdout)
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 10
        while alive(worker) and time.time() < deadline:
            time.sleep(0.02)
        assert not alive(worker)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if worker is not None and alive(worker):
            os.kill(worker, signal.SIGKILL)
