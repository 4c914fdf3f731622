"""Running a command the way the bench runs every one: one intra-op thread, this checkout
first on the path, its lines time-stamped as they arrive, ended with its process group."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

from benchmarks.peers.common import LAUNCH_ENV, ROOT


def child_env() -> dict:
    """The environment of every launched command: one intra-op thread, this checkout
    first on the path, unbuffered output (lines are time-stamped as they arrive), and
    none of an outer torchrun's variables."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_timed(cmd, cwd=None, timeout=None, env=None):
    """Run ``cmd``; return (exit code, wall seconds, [(seconds since launch, line)]).
    Past ``timeout`` seconds the command is ended (see :func:`kill_group`)."""
    import threading
    env = dict(env or child_env())
    t0 = time.perf_counter()
    env[LAUNCH_ENV] = repr(time.time())
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)  # its own group: see kill_group
    lines = []
    out = proc.stdout
    assert out is not None  # (PIPE)

    def read():
        for line in out:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        rc = proc.wait()
        lines.append((time.perf_counter() - t0, f"(killed after {timeout:.0f} s: --timeout)"))
    except BaseException:  # Ctrl-C: the command runs in its own session, so end it here
        kill_group(proc)
        raise
    wall = time.perf_counter() - t0
    reader.join(timeout=10)
    return rc, wall, lines


def kill_group(proc) -> None:
    """End a command this bench started: SIGTERM first (torchrun then stops its workers,
    which run in sessions of their own), SIGKILL to its process group after 10 s."""
    import signal
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(lines, n=15) -> str:
    return "\n".join(line for _, line in lines[-n:])


def git_head(d: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", d, "rev-parse", "HEAD"], check=False, capture_output=True,
                           text=True, timeout=10)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except OSError:
        return None
