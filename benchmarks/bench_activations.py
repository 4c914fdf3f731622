#!/usr/bin/env python
"""Activation memory and step time per recompute / sequence-parallel mode, on CPU.

    python -m benchmarks.bench_activations [--tp 2 4] [--budget-bytes 268435456]

For a GPT at each TP size (world = TP, one gloo process per rank, launched by
:func:`hybrid.testing.pool.run_ranks`) and each mode -- none, sp, selective,
sp+selective, full, full+partition, sp+full -- prints one JSON record:

* ``measured_bytes_per_layer``: what one layer leaves saved for backward at the
  end of forward, measured (:class:`hybrid.train.activation_meter.SavedActivationMeter`
  on an L-layer and a 1-layer model; the difference over L - 1), stored
  checkpoints included;
* ``table2_bytes_per_layer``: Korthikanti et al. 2022's Table 2 for that mode,
  adjusted for the dtype in use (``e`` bytes per activation instead of 2; masks
  only with dropout, of ``e`` bytes on the CPU, whose dropout keeps the scaled
  noise; the ``5as/(ht)`` scores term only when the attention kernel keeps
  scores: never with flash/memory-efficient SDPA), and
  ``table2_error`` (measured / formula - 1);
* ``peak_activation_bytes_per_rank``: the meter's high-water mark over a
  forward and backward (recompute's re-run block included);
* ``max_micro_batch_in_budget``: ``--budget-bytes`` over the peak bytes per sample;
* ``median_step_s`` (forward + backward, median over ``--steps`` steps of every
  rank after ``--warmup``; modes interleaved step by step, so the machine's
  drift hits all alike) and ``step_time_ratio_to_none``.

Memory is measured on separate steps from the timed ones (the hooks cost time).
Timings on a machine with fewer cores than ranks are noisy; nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

from benchmarks.timing import emit, interleaved, median_of
from hybrid.testing.pool import run_ranks

SP = {"sequence_parallel": True}
MODES = {"none": {}, "sp": SP,
         "selective": {"recompute_granularity": "selective"},
         "sp+selective": {**SP, "recompute_granularity": "selective"},
         "full": {"recompute_granularity": "full"},
         "full+partition": {"recompute_granularity": "full", "partition_activations": True},
         "sp+full": {**SP, "recompute_granularity": "full"}}


def table2_bytes_per_layer(mode: str, a, t: int, e: int) -> int:
    """Korthikanti et al.'s Table 2 for ``mode``, with e-byte activations (see the doc)."""
    s, b, h, heads = a.seq_length, a.micro_batch_size, a.hidden_size, a.heads
    sbh = s * b * h
    sp = "sp" in mode
    if "full" in mode:  # only the layer input: 2 sbh at e = 2
        return sbh * e // (t if sp or "partition" in mode else 1)
    # 10 sbh replicated at e = 2 (8 of activations, 2 of one-byte dropout masks),
    # 24 sbh / t split, 5 as^2 b / t of scores (4 of activations, 1 of mask). A mask
    # is one byte on CUDA; the CPU's dropout keeps its scaled noise, e bytes.
    mask = e  # this bench runs on the CPU
    masks = 2 * sbh * mask if a.dropout > 0 else 0
    replicated = 4 * sbh * e + masks
    split = 12 * sbh * e
    keeps_scores = a.attention_dropout > 0 and "selective" not in mode  # CPU: math kernel
    scores = (2 * e + mask) * heads * s * s * b if keeps_scores else 0
    return (replicated // t if sp else replicated) + (split + scores) // t


def _model(ps, a, flags, layers):
    from hybrid.config import Flags, build_config
    from hybrid.recompute.checkpointing import apply_activation_checkpointing
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import recompute_targets
    cfg = build_config(Flags(tensor_model_parallel_size=ps.tp_size, num_layers=layers,
                      hidden_size=a.hidden_size, num_attention_heads=a.heads,
                      seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                      hidden_dropout=a.dropout, attention_dropout=a.attention_dropout,
                      make_vocab_size_divisible_by=a.vocab_size // ps.tp_size,
                      **flags), ps.world_size)
    rng = seed_all(1234, ps.tp_rank, ps.dp_rank, ps.device)
    from models.gpt import GPT
    model = GPT(cfg.model.with_vocab_size(a.vocab_size), ps.tp_group, rng=rng, seed=1234,
                sequence_parallel=cfg.parallel.sequence_parallel)
    model.train()
    rc = cfg.recompute
    ac = (apply_activation_checkpointing(model, ps, rng, rc, blocks=recompute_targets(model, rc))
          if rc.granularity else None)
    return model, ac


def _bench(ps, a):
    from hybrid.train.activation_meter import SavedActivationMeter
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=g)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    runs = {m: dict(zip(("model", "ac"), _model(ps, a, f, a.num_layers))) for m, f in MODES.items()}

    def step(r):
        r["model"].zero_grad(set_to_none=False)
        r["model"](tokens, labels).backward()

    times = interleaved({m: functools.partial(step, r) for m, r in runs.items()},
                        a.steps, a.warmup)
    out = {}
    for mode, r in runs.items():
        one_layer = dict(zip(("model", "ac"), _model(ps, a, MODES[mode], 1)))
        held = {}
        for name, run in (("L", r), ("1", one_layer)):
            ac = run["ac"]
            meter = SavedActivationMeter(extra=ac.stored_bytes if ac else lambda: 0)
            with meter:
                loss = run["model"](tokens, labels)
                held[name] = meter.held()
                loss.backward()
            held[name + "_peak"] = meter.peak
        out[mode] = {"times": times[mode], "peak": held["L_peak"],
                     "per_layer": (held["L"] - held["1"]) / (a.num_layers - 1)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0, help="hidden dropout")
    ap.add_argument("--attention-dropout", type=float, default=0.0,
                    help="> 0 runs the CPU's math attention kernel, which keeps the scores")
    ap.add_argument("--budget-bytes", type=int, default=256 * 2**20,
                    help="per-rank activation memory budget for max_micro_batch_in_budget")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for tp in a.tp:
        ranks = run_ranks(_bench, tp, tp, args=(a,), timeout=3600)
        med = {m: median_of(t for r in ranks for t in r[m]["times"]) for m in MODES}
        for mode in MODES:
            peak = max(r[mode]["peak"] for r in ranks)
            per_layer = max(r[mode]["per_layer"] for r in ranks)
            formula = table2_bytes_per_layer(mode, a, tp, 4)
            emit({
                "tp": tp, "mode": mode, "layers": a.num_layers,
                "micro_batch_size": a.micro_batch_size, "seq_length": a.seq_length,
                "hidden_size": a.hidden_size, "dtype": "fp32",
                "measured_bytes_per_layer": int(per_layer),
                "table2_bytes_per_layer": formula,
                "table2_error": round(per_layer / formula - 1, 4),
                "fraction_of_none_per_layer": round(
                    per_layer / max(r["none"]["per_layer"] for r in ranks), 4),
                "peak_activation_bytes_per_rank": peak,
                "max_micro_batch_in_budget": int(a.budget_bytes // (peak / a.micro_batch_size)),
                "budget_bytes": a.budget_bytes,
                "median_step_s": round(med[mode], 4),
                "step_time_ratio_to_none": round(med[mode] / med["none"], 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
