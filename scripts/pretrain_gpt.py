#!/usr/bin/env python
"""Pretrain a GPT with tensor x data parallelism. Launch with torchrun (see pretrain_gpt.sh).

Thin on purpose: parse and check the flags, join the process groups, train.
A bad flag ends every rank with one line naming it and exit code 2, before
any process group exists, so nothing can hang on it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from hybrid.config import build_config, parse_args  # no torch import: fast preflight
from hybrid.errors import USER_ERRORS, ConfigError
from hybrid.train.error_report import report_error_line
from hybrid.train.orphans import end_with_launcher

_STARTED = time.time()  # this process's start, when no launcher said when the job began


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _launched_at() -> float:
    """When the job was launched (epoch seconds): pretrain_gpt.sh's HYBRID_LAUNCHED_AT, so
    launch-to-first-iteration counts the launcher too; else this process's start."""
    try:
        return float(os.environ["HYBRID_LAUNCHED_AT"])
    except (KeyError, ValueError):
        return _STARTED


def _fail(msg: str) -> int:
    """Say this rank's one error line and return exit code 2.

    Under pretrain_gpt.sh the line goes to this rank's torchrun error file, and the
    launcher prints one line for the job: the first failing rank's (the lowest of
    those failing in the same second), however many ranks got that far before it
    stopped the rest. Run any other way (one process, plain torchrun) each failing
    rank prints its own line at once.
    """
    rank = int(os.environ.get("RANK", "0"))
    where = "" if rank == 0 else f" (rank {rank})"
    line = f"pretrain_gpt.py: error{where}: {msg}"
    if not report_error_line(line, os.environ):  # hybrid/train/error_report.py's Note
        print(line, file=sys.stderr, flush=True)
    return 2


def _collective_fail(e) -> int:
    """A failed collective: the reporting rank prints the job's one report, every other
    rank one line pointing to it (hybrid/diagnostics/recorder.py); both at once, since
    the ranks already agreed who reports, and the others waited for this print."""
    rank = int(os.environ.get("RANK", "0"))
    if e.reporter:
        print(f"pretrain_gpt.py: error (rank {rank}): {e}", file=sys.stderr, flush=True)
        e.reported()  # the others may exit now (and the launcher stop this rank)
    else:
        print(f"pretrain_gpt.py: {e}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check_only = "--check-config" in argv
    if not check_only:  # a worker (the preflight is the launcher's own child, not one)
        end_with_launcher(os.environ)  # first: it arms a signal, then checks for the race
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # Ctrl-C reaches a worker from the launcher, which then says the job's one line
        # "stopped by SIGINT": end here as on its SIGTERM, without a KeyboardInterrupt
        # traceback per rank from wherever it struck. A stop that saves first is SIGTERM's
        # with --exit-signal-handler.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    argv = [a for a in argv if a != "--check-config"]
    try:
        cfg = build_config(parse_args(argv), _world_size(), environ=os.environ)
    except ConfigError as e:
        return _fail(str(e))
    if check_only:  # the launcher's preflight: flags are fine for this world size
        return 0

    from hybrid.checkpoint.ownership import RunIdentity
    from hybrid.kernels import configure
    from hybrid.parallel.comm import CollectiveError
    from hybrid.parallel.state import init_distributed
    from hybrid.parallel.teardown import teardown
    from hybrid.train.early_exit import stopped_by_signal
    from hybrid.train.monitor import setup_logging
    from hybrid.train.trainer import pretrain

    configure(cfg.kernels)  # --no-kernels, --kernel-cache-dir, --kernel-choice (or HYBRID_*)
    par = cfg.parallel
    diag = cfg.diagnostics
    ps = init_distributed(par.tensor_model_parallel_size, par.timeout_minutes, par.backend,
                          diag.collective_dump_dir, diag.check_collectives,
                          par.context_parallel_size, par.pipeline_model_parallel_size,
                          par.expert_model_parallel_size, par.expert_tensor_parallel_size)
    # NCCL: a hang is found by the recorder's heartbeat, not raised here; say it the same
    # way, then end the process (hybrid/diagnostics/watch.py)
    ps.recorder.on_hang = lambda e: os._exit(_collective_fail(e))
    setup_logging(ps.rank)
    try:
        # the launch's identity: a worker torchrun restarts is the same run, so the
        # --save directory it owns stays its own (hybrid/checkpoint/ownership.py)
        pretrain(cfg, ps, launched_at=_launched_at(), run=RunIdentity.of_launch(os.environ))
    except USER_ERRORS as e:
        return _fail(str(e))
    except CollectiveError as e:
        return _collective_fail(e)
    finally:
        # The process groups go now, while the interpreter is whole: a gloo thread
        # still running at interpreter shutdown aborts a run that finished
        # ("terminate called without an active exception"; hybrid/parallel/teardown.py)
        teardown(ps)
    stopped = stopped_by_signal()  # --exit-signal-handler saved, then stopped: 128 + signal
    return 128 + int(stopped) if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
