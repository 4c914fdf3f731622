#!/usr/bin/env python
"""torchrun, minus its failure report: what pretrain_gpt.sh launches the workers with.

Takes torchrun's command line and runs it in this process. A worker that fails
with a bad flag, file or checkpoint has already printed its one
``pretrain_gpt.py: error: ...`` line; torchrun would add its own ~40 lines
(a traceback of the launcher and a ChildFailedError table) and exit 1, burying
that line. Here the job instead exits with the worker's own exit code (2 for
bad input) and nothing more is printed. A worker that died without a word (a
signal: out of memory, killed) gets one line naming the rank and the signal.

``LOGLEVEL`` (torchrun's own variable) set in the environment keeps torchrun's
process-management log lines; by default those below CRITICAL are dropped on
a failure path (they are about the SIGTERMs the launcher sends, not the cause).
"""

from __future__ import annotations

import logging
import os
import signal
import sys


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


def main(argv: list[str] | None = None, environ=os.environ) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if "LOGLEVEL" not in environ:
        # the worker's SIGTERMs and exit codes, logged by the agent as it stops the job
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(
            logging.CRITICAL)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = _root_failure(e.failures)
        if failure.exitcode > 0:
            return failure.exitcode  # the worker printed its own error line
        sig = failure.signal_name()
        hint = " (out of memory? see dmesg)" if failure.exitcode == -signal.SIGKILL else ""
        print(f"pretrain_gpt.sh: error: rank {rank} (pid {failure.pid}) was killed by "
              f"{sig}{hint}", file=sys.stderr, flush=True)
        return 128 - failure.exitcode
    except SignalException as e:  # the launcher itself was stopped (Ctrl-C, timeout, scancel)
        print(f"pretrain_gpt.sh: stopped by {signal.Signals(e.sigval).name}", file=sys.stderr,
              flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
