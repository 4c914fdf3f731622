"""Record DeepSpeed's numbers for the cases of :mod:`tests.hybrid_deepspeed.cases`.

    python -m tests.hybrid_deepspeed.record_deepspeed                 # every case
    python -m tests.hybrid_deepspeed.record_deepspeed --cases zero1,zero2 --out /tmp/rec

Runs each case under the installed DeepSpeed (``import deepspeed``) on the CPU at 2
ranks: two local processes on 127.0.0.1 joined as torchrun's workers would be
(RANK, WORLD_SIZE, MASTER_ADDR, ...; ``DS_ACCELERATOR=cpu``, gloo, one thread each),
all the cases one after another in one launch. It writes ``<out>/<case>.json``
(default ``tests/hybrid_deepspeed/recorded/``) holding the case's docstring and exact
ds_config, the DeepSpeed / torch / transformers versions, and each rank's per
micro-batch losses, per step learning rates and extra numbers
(:mod:`tests.hybrid_deepspeed.cases.common` says what each is).

The nvme case (``unused_parameters_nvme``) needs DeepSpeed's async I/O op, which builds
against libaio: ``apt-get install libaio-dev`` first (the op's JIT build then takes about
4 minutes on 2 cores, once per ``TORCH_EXTENSIONS_DIR``).

Deterministic: the same versions give the same files, byte for byte (seeded models
and data, one intra-op thread, nothing timed or dated in the record). A case that
raises under DeepSpeed stops the recording with that rank's traceback: the recorded
numbers are DeepSpeed's, never a placeholder.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from tests.helpers.launch import free_port
from tests.hybrid_deepspeed.cases import CASES

WORLD_SIZE = 2
RECORDED = pathlib.Path(__file__).resolve().parent / "recorded"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """The versions a recording depends on, as installed here."""
    return {p: _version(p) for p in ("deepspeed", "torch", "transformers")}



def record(names=None, out: str | os.PathLike = RECORDED, timeout: float = 600.0
           ) -> dict[str, dict]:
    """Run ``names`` (default: every case) under DeepSpeed at 2 ranks, write
    ``<out>/<case>.json`` for each and return the records by case. Raises
    RuntimeError naming the rank and its log when a rank fails or runs past
    ``timeout`` seconds."""
    names = list(CASES) if names is None else list(names)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"no such case: {', '.join(unknown)} (the cases: {', '.join(CASES)})")
    with tempfile.TemporaryDirectory(prefix="record_deepspeed_") as tmp:
        port = free_port()
        procs = []
        for rank in range(WORLD_SIZE):
            env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                       LOCAL_WORLD_SIZE=str(WORLD_SIZE), PYTHONHASHSEED="0")
            cmd = [sys.executable, "-m", "tests.hybrid_deepspeed.record_deepspeed", "--worker",
                   "--cases", ",".join(names), "--workdir", os.path.join(tmp, "work"),
                   "--result", os.path.join(tmp, f"rank{rank}.json")]
            # the worker holds its own copy of the log's descriptor
            with open(os.path.join(tmp, f"rank{rank}.log"), "w") as log:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        try:
            for rank, p in enumerate(procs):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"rank {rank} ran past {timeout:.0f} s; its log:\n"
                                       f"{_tail(tmp, rank)}") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        by_rank = []
        for rank in range(WORLD_SIZE):
            path = os.path.join(tmp, f"rank{rank}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} exited {procs[rank].returncode} without "
                                   f"results; its log:\n{_tail(tmp, rank)}")
            with open(path) as f:
                by_rank.append(json.load(f))
    records = {}
    for name in names:
        ranks = [r["results"][name] for r in by_rank]
        for rank, got in enumerate(ranks):
            if "error" in got:
                raise RuntimeError(f"case {name} failed under DeepSpeed on rank {rank}:\n"
                                   f"{got['traceback']}")
        c = CASES[name]
        records[name] = {"case": name, "script": c.doc, "config": c.config,
                         "world_size": WORLD_SIZE, "versions": by_rank[0]["versions"],
                         "ranks": ranks}
    os.makedirs(out, exist_ok=True)
    for name, rec in records.items():
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
    return records


def _tail(tmp: str, rank: int, chars: int = 6000) -> str:
    with open(os.path.join(tmp, f"rank{rank}.log")) as f:
        return f.read()[-chars:]


def _worker(names: list[str], workdir: str, result: str) -> None:
    """One rank: every case under ``import deepspeed``, the results into ``result``."""
    import torch
    torch.set_num_threads(1)
    import deepspeed

    from tests.hybrid_deepspeed.cases import run_cases
    results = run_cases(deepspeed, names, workdir)
    with open(result + ".part", "w") as f:
        json.dump({"versions": versions(), "results": results}, f)
    os.replace(result + ".part", result)
    deepspeed.comm.barrier()  # neither rank leaves while the other may still need it
    sys.stdout.flush()
    sys.stderr.flush()
    # The results are written: end here, before interpreter teardown, where a gloo
    # worker thread still freeing a finished collective's tensors can abort the
    # process (hybrid/parallel/teardown.py tells that story).
    os._exit(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names (default: every case)")
    parser.add_argument("--out", default=str(RECORDED), help="where to write <case>.json")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.cases.split(",") if args.cases else list(CASES)
    if args.worker:
        _worker(names, args.workdir, args.result)
        return 0
    start = time.monotonic()
    records = record(names, args.out, args.timeout)
    print(f"recorded {len(records)} cases under DeepSpeed {versions()['deepspeed']} "
          f"(torch {versions()['torch']}) at {WORLD_SIZE} ranks in "
          f"{time.monotonic() - start:.1f} s into {args.out}:")
    for name, rec in records.items():
        print(f"  {name}: {len(rec['ranks'][0]['losses'])} micro-batches, "
              f"{len(rec['ranks'][0]['lrs'])} steps, rank 0's last loss "
              f"{rec['ranks'][0]['losses'][-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
