#!/usr/bin/env python
"""torchrun, minus its failure report: what pretrain_gpt.sh launches the workers with.

Takes torchrun's command line and runs it in this process. A worker that fails
with a bad flag, file or checkpoint writes its one ``pretrain_gpt.py: error: ...``
line to its torchrun error file; torchrun would print its own ~40 lines (a
traceback of the launcher and a ChildFailedError table) and exit 1. Here the job
instead prints the line of the first rank to fail, once however many ranks failed
the same way (hybrid/train/error_report.py's Note), and exits with that worker's
own exit code (2 for bad input). A worker that died without a word (a
signal: out of memory, killed) gets one line naming the rank and the signal.
Each restart (``--max-restarts``) gets one line too: the rank that died and
how, and the iteration the job resumes from. A stop by a signal to this
process (Ctrl-C, ``scancel``) is one line, ``pretrain_gpt.sh: stopped by ...``.

The workers learn this process's pid (:data:`hybrid.train.orphans.LAUNCHER_PID`),
so that they end with it however it ends (``kill -9`` included): see
:mod:`hybrid.train.orphans`.

``LOGLEVEL`` (torchrun's own variable) set in the environment keeps torchrun's
process-management log lines; by default those below CRITICAL are dropped on
a failure path (they are about the SIGTERMs the launcher sends, not the cause).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from hybrid.train.error_report import LAUNCHER_REPORTS, reported_line
from hybrid.train.orphans import LAUNCHER_PID


def _root_failure(failures: dict):
    """(rank, failure) that explains the job's end: the first worker that exited with an
    error of its own (exit code > 0, it said why), else the first killed by a signal other
    than the SIGTERM the launcher sends to the survivors, else the first."""
    said = [r for r, f in failures.items() if f.exitcode > 0]
    killed = [r for r, f in failures.items() if f.exitcode < 0 and
              f.exitcode != -signal.SIGTERM]
    ranks = said or killed or list(failures)
    rank = min(ranks, key=lambda r: (failures[r].timestamp, r))
    return rank, failures[rank]


def _say_line(failure) -> None:
    """Print the error line the failed worker wrote to its error file, if it wrote one
    (a worker that died, or printed its own traceback, wrote none)."""
    line = reported_line(failure.error_file_data)
    if line is not None:
        print(line, file=sys.stderr, flush=True)


def _how(failure) -> str:
    """How a worker ended, as a sentence's end: killed by which signal, or its exit code."""
    if failure.exitcode > 0:
        return f"exited with code {failure.exitcode}"
    hint = " (out of memory? see dmesg)" if failure.exitcode == -signal.SIGKILL else ""
    return f"was killed by {failure.signal_name()}{hint}"


def _resume_point(script_args: list[str]) -> str:
    """Where a restarted job starts, read from disk as its workers will: the newest
    complete checkpoint of ``--load`` (of ``--save`` for a ``--finetune`` run that
    saved already: checkpoint/resume.py), else iteration 0."""
    from hybrid.checkpoint import find_checkpoint
    from hybrid.config import parse_args
    from hybrid.errors import USER_ERRORS
    try:
        flags = parse_args(script_args)
        ckpt = None
        if flags.finetune and flags.save and os.path.isdir(flags.save):
            ckpt = find_checkpoint(flags.save)
        if ckpt is None and flags.load and not flags.finetune:
            ckpt = find_checkpoint(flags.load)
    except (*USER_ERRORS, OSError):  # the workers will say what is wrong with it
        return "its --load"
    if ckpt is None:
        return "iteration 0"
    iteration = os.path.basename(ckpt).removeprefix("iter_").lstrip("0") or "0"
    return f"iteration {iteration} ({ckpt})"


def _restart_reporting(agent_class: type, script_args: list[str]) -> type:
    """``agent_class`` (torchrun's elastic agent), saying in one line why it restarts.

    Overrides two of the methods every torchrun agent implements (the abstract
    ``_monitor_workers`` and ``_start_workers`` of torch's SimpleElasticAgent): the
    failures a check returns are kept, and when workers start again after them,
    that start is a restart.
    By then the old workers are stopped, so the checkpoint on disk is the one
    the new workers load.
    """

    class RestartReportingAgent(agent_class):
        _failures: dict | None = None
        _restarts = 0

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.failures:
                self._failures = result.failures
            return result

        def _start_workers(self, worker_group):
            if self._failures:
                self._restarts += 1
                rank, failure = _root_failure(self._failures)
                self._failures = None
                _say_line(failure)
                print(f"pretrain_gpt.sh: rank {rank} (pid {failure.pid}) {_how(failure)}; "
                      f"restart {self._restarts} of {worker_group.spec.max_restarts}, "
                      f"resuming from {_resume_point(script_args)}", file=sys.stderr,
                      flush=True)
            return super()._start_workers(worker_group)

    return RestartReportingAgent


def _stopped(sig: int) -> int:
    print(f"pretrain_gpt.sh: stopped by {signal.Signals(sig).name}", file=sys.stderr,
          flush=True)
    return 128 + int(sig)


def _stop_signal_behind(error: BaseException, signal_exception: type):
    """The stop signal (torch's ``SignalException``) ``error`` was raised while handling,
    or None.

    [Note: a stop that lands on torch's metrics wrapper]
    torchrun's agent methods run inside a metrics decorator whose ``finally`` reads the
    start time its ``try`` took first. A SIGTERM whose handler raises before that
    assignment (seen on a loaded machine: ``start = time.time()``) makes the ``finally``
    raise ``UnboundLocalError`` in place of the ``SignalException``; the agent still
    stops the workers (its own ``finally``), and the stop is still what ended the job.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, signal_exception):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def main(argv: list[str] | None = None, environ=os.environ) -> int:
    try:
        return _launch(sys.argv[1:] if argv is None else argv, environ)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's own handlers are in place
        return _stopped(signal.SIGINT)


def _launch(argv: list[str], environ) -> int:
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if "LOGLEVEL" not in environ:
        # the worker's SIGTERMs and exit codes, logged by the agent as it stops the job
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(
            logging.CRITICAL)
        # "Received 2 death signal, shutting down workers": the line below says it
        logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(
            logging.ERROR)
    args = parse_args(argv)
    environ[LAUNCHER_PID] = str(os.getpid())  # the workers' parent: hybrid/train/orphans.py
    environ[LAUNCHER_REPORTS] = "1"  # a worker's error line is this process's to print
    # torchrun builds its agent inside run(), from this module's name for the class: the
    # only place to give it the restart line
    # (a module's class replaced for the run: what mypy refuses for a declared class)
    agent_class = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = _restart_reporting(  # type: ignore[misc, assignment]
        agent_class, args.training_script_args)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = _root_failure(e.failures)
        if failure.exitcode > 0:
            _say_line(failure)
            return failure.exitcode
        print(f"pretrain_gpt.sh: error: rank {rank} (pid {failure.pid}) {_how(failure)}",
              file=sys.stderr, flush=True)
        return 128 - failure.exitcode
    except SignalException as e:  # the launcher itself was stopped (Ctrl-C, timeout, scancel)
        return _stopped(e.sigval)
    except Exception as e:
        stop = _stop_signal_behind(e, SignalException)
        if stop is None:
            raise
        return _stopped(stop.sigval)
    finally:
        launcher_api.LocalElasticAgent = agent_class  # type: ignore[misc]
    return 0


if __name__ == "__main__":
    sys.exit(main())
