"""What every part of the peers bench shares: paths, the TP shape, the optimizer settings,
the tags between parent and workers, and the progress line."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")
ENTRY = ["-m", "benchmarks.bench_peers"]  # what torchrun runs with --worker (cwd: ROOT)
RESULT_TAG = "BENCH_PEERS_RESULT "
LAUNCH_ENV = "BENCH_PEERS_LAUNCH_T"  # time.time() at launch, read by the workers
# The TP shape of the issue: GPT-2 4 x 256, 4 heads, seq 128, vocab 8192, micro 4 per rank
TP_SHAPE = dict(num_layers=4, hidden_size=256, heads=4, seq_length=128, vocab=8192, micro=4)
LR, WEIGHT_DECAY, CLIP, SEED = 1e-4, 0.01, 1.0, 1234


def mean_eval_loss(model, loss, batches) -> float:
    """Mean of ``loss(tokens, labels)`` over ``batches`` with ``model`` in eval mode
    and no autograd (the evaluation both TP sides time); ``model`` back in train mode."""
    import torch
    model.eval()
    with torch.no_grad():
        total = sum(float(loss(x, y)) for x, y in batches)
    model.train()
    return total / len(batches)


def progress(a, msg: str) -> None:
    if not a.quiet:
        print(f"# {msg}", file=sys.stderr, flush=True)
