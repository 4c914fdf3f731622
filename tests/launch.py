"""Run scripts/pretrain_gpt.py (or its .sh launcher) as a user would, for end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.py")

# A model small enough that a 4-process run takes seconds on 2 cores.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--log-interval", "1", "--seed", "11"]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def torchrun(nproc: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(),
                          cwd=ROOT)


def read_json_log(path: str, split: str | None = None) -> list[dict]:
    """Training records of a --log-json file (or the evaluations of ``split``)."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("split") == split]
