"""Seconds from a fresh process to the first global batch of a blended run resumed late.

Prints one JSON object: for each ``consumed_samples``, a new process builds a
BlendedSamples over three GPTSamples (synthetic tokens, sample orders not cached
on disk, so each dataset's epoch permutation is built too) and fetches the whole
global batch at that position with ``dp_micro_batches``. ``build_s`` covers the
blend's construction, ``batch_s`` the batch, ``total_s`` both (imports excluded).

    python -m benchmarks.bench_data_resume
    python -m benchmarks.bench_data_resume --consumed 1e8 1.5e8 --global-batch-size 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.timing import Stopwatch, emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(consumed: int, gbs: int, seq: int) -> dict:
    import numpy as np
    import torch

    from hybrid.data.blending import BlendedSamples
    from hybrid.data.dataset import GPTSamples, dp_micro_batches

    sizes, weights = (50_000_000, 20_000_000, 8_000_000), (0.5, 0.3, 0.2)
    tokens = [np.zeros(n, dtype=np.uint16) for n in sizes]
    with Stopwatch() as build:
        blend = BlendedSamples([GPTSamples(t, seq, seed) for seed, t in enumerate(tokens)],
                               weights)
    with Stopwatch() as batch:
        batches = dp_micro_batches(blend, consumed, gbs, 4, 0, 1, torch.device("cpu"))
    assert sum(len(x) for x, _ in batches) == gbs
    return {"consumed_samples": consumed, "build_s": round(build.seconds, 4),
            "batch_s": round(batch.seconds, 4),
            "total_s": round(build.seconds + batch.seconds, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--consumed", type=float, nargs="+", default=[1e8, 1.5e8])
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        emit(measure(a.child, a.global_batch_size, a.seq_length))
        return
    runs = []
    for c in a.consumed:
        r = subprocess.run([sys.executable, "-m", "benchmarks.bench_data_resume",
                            "--child", str(int(c)),
                            "--global-batch-size", str(a.global_batch_size),
                            "--seq-length", str(a.seq_length)],
                           capture_output=True, text=True, check=True, cwd=ROOT)
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    emit({"datasets": 3, "weights": [0.5, 0.3, 0.2], "global_batch_size": a.global_batch_size,
          "seq_length": a.seq_length, "runs": runs})


if __name__ == "__main__":
    main()
