"""Run scripts/pretrain_gpt.py (or its .sh launcher) as a user would, for end-to-end tests.

``torchrun(n, argv)`` launches the real script under torchrun: for what only the
launcher does (exit codes of a whole job, restarts, rendezvous). ``pretrain(n,
argv)`` does what the script does -- parse and validate ``argv`` for the world
size, ``hybrid.train.trainer.pretrain`` on every rank, a library error becomes one
``pretrain_gpt.py: error: ...`` line and exit code 2 -- on the pooled ranks of
:func:`hybrid.testing.pool.run_ranks`, writing the same ``--log-json`` and
``--save`` files, seconds faster per run. Both return a CompletedProcess.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.py")

# A model small enough that a 4-process run takes seconds on 2 cores. --eval-iters 1: a run
# that finishes evaluates its test split on one batch, not the default 10, which cost as
# much as these runs' 3-6 training steps (no test reads that loss; a test that wants more
# evaluation says so after TINY, whose flags it overrides).
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--log-interval", "1", "--seed", "11", "--eval-iters", "1"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a launch's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(name: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``python scripts/<name>.py argv`` as a CompletedProcess, run through the script's
    main() in this process (a torch import, about a second of CPU, saved per call): its
    exit code (main's return, or SystemExit's), what it printed to stdout and stderr."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = script_module(name).main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess([name, *argv], code or 0, out.getvalue(), err.getvalue())


def script_module(name: str):
    """scripts/<name>.py as a module, so a test calls its main() in this process."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env() -> dict:
    """The environment of a script run as a subprocess. The scripts import the installed
    package (``pip install -e .``); ROOT first on PYTHONPATH makes them import this
    checkout's, the code under test, even where the install points at another one."""
    e = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def torchrun(nproc: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, check=False, text=True, timeout=timeout,
                          env=env(), cwd=ROOT)


def _pretrain_rank(ps, cfg):
    """scripts/pretrain_gpt.py's main() on one pooled rank: (exit code, stdout, error,
    whether the error is the job's collective report)."""
    import io
    import logging

    from hybrid.errors import USER_ERRORS
    from hybrid.kernels import configure
    from hybrid.parallel.comm import CollectiveError
    from hybrid.train.trainer import pretrain

    configure(cfg.kernels)  # as main() does
    # main() builds its ParallelState with these; a pooled rank's serves many runs
    ps.recorder.configure(cfg.diagnostics.collective_dump_dir, cfg.diagnostics.check_collectives)

    # setup_logging(rank)'s console, captured: INFO on rank 0, warnings elsewhere
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("hybrid")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if ps.rank == 0 else logging.WARNING)
    try:
        pretrain(cfg, ps)
    except USER_ERRORS as e:
        return 2, out.getvalue(), str(e), False
    except CollectiveError as e:
        e.reported()  # as the script does once it printed the report
        return 2, out.getvalue(), str(e), e.reporter
    finally:
        log.removeHandler(handler)
    return 0, out.getvalue(), None, False


def pretrain(nproc: int, args: list[str], timeout: float = 300, reuse: bool = True,
             rank_fn=None, grace_s: float = 5.0) -> subprocess.CompletedProcess:
    """The work of ``torchrun(nproc, args)``, run on pooled ranks (see the module doc).

    Like torchrun, once one rank fails the job ends: ranks still running
    ``grace_s`` seconds later are stopped. ``reuse=False``: on fresh processes whose
    collectives time out after ``--distributed-timeout-minutes`` (for runs that
    stop or lose a rank). ``rank_fn(ps, cfg)``: what each rank runs instead of
    :func:`_pretrain_rank` (a module-level function that ends by calling it).
    """
    import contextlib
    import io

    from hybrid.config import build_config, parse_args
    from hybrid.errors import ConfigError
    from hybrid.testing.pool import run_ranks

    argv = ["pretrain", str(nproc), *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = build_config(parse_args(list(args)), nproc, environ=os.environ)  # as main()
    except ConfigError as e:
        return subprocess.CompletedProcess(argv, 2, "", f"pretrain_gpt.py: error: {e}\n")
    except SystemExit as e:  # argparse: unknown flag or bad value, already said on err
        return subprocess.CompletedProcess(argv, e.code, "", err.getvalue())
    extra = {} if reuse else {"collective_timeout": cfg.parallel.timeout_minutes * 60}
    res = run_ranks(rank_fn or _pretrain_rank, world_size=nproc,
                    tp=cfg.parallel.tensor_model_parallel_size,
                    cp=cfg.parallel.context_parallel_size,
                    pp=cfg.parallel.pipeline_model_parallel_size,
                    ep=cfg.parallel.expert_model_parallel_size,
                    etp=cfg.parallel.expert_tensor_parallel_size, args=(cfg,), timeout=timeout,
                    early_exit=lambda r: r[0] != 0, grace_s=grace_s, reuse=reuse, **extra)
    done = {rank: r for rank, r in enumerate(res) if r is not None}
    failed = [rank for rank, r in done.items() if r[0] != 0]
    stdout = "".join(r[1] for r in done.values())
    if not failed:
        return subprocess.CompletedProcess(argv, 0, stdout, "")
    reports = [rank for rank in failed if done[rank][3]]
    if reports:  # scripts/pretrain_gpt.py's _collective_fail: the report, then pointers
        lines = [f"pretrain_gpt.py: error (rank {reports[0]}): {done[reports[0]][2]}\n"]
        lines += [f"pretrain_gpt.py: {done[rank][2]}\n" for rank in failed
                  if rank != reports[0]]
        return subprocess.CompletedProcess(argv, 2, stdout, "".join(lines))
    # what pretrain_gpt.sh's launcher says (hybrid/train/error_report.py): one failing
    # rank's line, the lowest rank's here (the launcher's: the first second's lowest)
    rank = failed[0]
    where = "" if rank == 0 else f" (rank {rank})"
    return subprocess.CompletedProcess(argv, done[rank][0], stdout,
                                       f"pretrain_gpt.py: error{where}: {done[rank][2]}\n")


def read_json_log(path: str, split: str | None = None) -> list[dict]:
    """Training records of a --log-json file (or the evaluations of ``split``)."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("split") == split]


def child_pids(parent: int) -> list[int]:
    """pids of ``parent``'s children (a launcher's workers: pretrain_gpt.sh exec's the
    launcher, so its pid is the shell's)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True,
                         check=False, text=True).stdout
    return [int(pid) for pid in out.split()]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (dead, not yet reaped) does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def pretrain_rank_with(ps, cfg, owner, attr: str, replacement, suffix: str, result):
    """:func:`_pretrain_rank` with ``owner.attr`` replaced by ``replacement`` for the run
    (restored after, also on failure), then ``result()`` written as JSON beside the
    --log-json file as ``<log>.<suffix><rank>``: what a test's rank function records
    about the run it watches (``rank_fn=`` of :func:`pretrain`)."""
    orig = getattr(owner, attr)
    setattr(owner, attr, replacement)
    try:
        return _pretrain_rank(ps, cfg)
    finally:
        setattr(owner, attr, orig)
        with open(f"{cfg.logging.log_json}.{suffix}{ps.rank}", "w") as f:
            json.dump(result(), f)

