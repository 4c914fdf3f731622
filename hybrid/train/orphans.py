"""No worker outlives its launcher: a worker asks the kernel to end it when the process
that started it dies.

A launcher killed outright (``kill -9``, the OOM killer, a scheduler's hard kill)
runs no code on its way out, so nothing tells its workers; without this they go
on training to the last iteration with nobody watching, and a relaunch then runs
two jobs into one save directory. Linux's parent-death signal
(``prctl(PR_SET_PDEATHSIG)``) is delivered by the kernel itself the moment the
parent goes, however it went.

[Note: SIGKILL, not SIGTERM]
The launcher's death is a hard stop of the whole job: there is no one left to
restart it, report it, or keep its saves apart from a relaunch's. SIGTERM would
kill a plain run just the same (its default action), but with
``--exit-signal-handler`` it would start one more save, unsupervised, possibly
into the directory a relaunched job is already using; on several nodes the
ranks whose launcher still lives would join it and stop as on a preemption,
when the job has in fact lost a node. SIGKILL ends the worker where it is. A
checkpoint write in flight is then abandoned in its ``.tmp_iter_*`` directory
and never renamed, so the previous checkpoint stays the newest complete one
(hybrid/checkpoint/save.py), as for any SIGKILL.

[Note: the race]
The signal is armed only once the worker runs this, a little after the
launcher started it; a launcher that died in between has already left the
worker to another parent, and arming then waits for the wrong death. So the
parent is checked after arming against the launcher's pid, which the launcher
exports (:data:`LAUNCHER_PID`; ``scripts/torchrun_quiet.py`` does): a
different parent means the launcher is gone, and the worker ends at once.
Under a plain ``torchrun``, whose agent exports no pid, the signal is armed
but that window stays open; ``HYBRID_LAUNCHER_PID=$$ exec torchrun ...`` in a
shell script closes it too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping

# The pid of the process that starts the workers, exported by the launcher.
LAUNCHER_PID = "HYBRID_LAUNCHER_PID"
# Set by torchrun's agent in every worker's environment: the agent is the parent.
_TORCHRUN = "TORCHELASTIC_RUN_ID"

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DEATH_SIGNAL = signal.SIGKILL  # see [Note: SIGKILL, not SIGTERM]


def end_with_launcher(environ: Mapping[str, str]) -> bool:
    """Arrange for this process to be killed (SIGKILL) when its launcher dies; True
    when armed.

    ``environ``: the process's environment, passed by the entry point. A process
    is a launched worker when it names its launcher's pid (:data:`LAUNCHER_PID`) or
    runs under torchrun; any other (a script started by hand, under ``nohup``) is
    left alone, as is every process off Linux. When the launcher's pid is known
    and this process's parent is no longer it, the launcher died before the
    signal was armed, and this process is killed at once (see [Note: the race]).
    Call it first thing in the worker, in the main thread.
    """
    launcher = environ.get(LAUNCHER_PID, "")
    if not sys.platform.startswith("linux") or not (launcher or _TORCHRUN in environ):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0) != 0:
            return False  # refused (a seccomp policy): run on as before
    except (OSError, AttributeError):  # no libc to load, or no prctl in it
        return False
    if launcher.isdigit() and os.getppid() != int(launcher):
        os.kill(os.getpid(), DEATH_SIGNAL)  # the death that came before the arming
    return True
