#!/usr/bin/env python
"""Activation memory and step time of ZeRO-R checkpointing modes, on CPU.

    python scripts/bench_activations.py [--tp 2 4] [--budget-mib 64]

For a GPT at each TP size (world = TP, one process per rank), and each mode --
none, recompute, recompute+partition, recompute+partition+cpu -- prints one
JSON record: median step time (after warm-up) and its ratio to plain
recompute; peak activation bytes per rank (tensors autograd saved for backward,
excluding parameters, plus stored checkpoints, at their high-water mark);
checkpoint bytes alone; and the largest micro-batch whose activations fit in
``--budget-mib`` per rank, from the measured bytes per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hybrid.multiprocess import run_ranks  # noqa: E402

MODES = {"none": {}, "recompute": {"recompute_activations": True},
         "recompute+partition": {"recompute_activations": True, "partition_activations": True},
         "recompute+partition+cpu": {"recompute_activations": True,
                                     "partition_activations": True, "cpu_checkpointing": True}}


class _SavedBytes:
    """High-water mark of the bytes autograd holds for backward (non-parameter storages)."""

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list] = {}  # storage ptr -> [bytes, refcount]
        self.now = self.peak = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or t.device.type == "meta":
            return t
        entry = self.live.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
        entry[1] += 1
        return _Held(t, ptr, self)

    def unpack(self, h):
        return h.t if isinstance(h, _Held) else h

    def drop(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]


class _Held:
    def __init__(self, t, ptr, owner):
        self.t, self.ptr, self.owner = t, ptr, owner

    def __del__(self):
        self.owner.drop(self.ptr)


def _bench(ps, mode, a):
    from hybrid.activation_checkpointing import apply_activation_checkpointing
    from hybrid.config import TrainConfig
    from hybrid.tensor_parallel import seed_all
    from hybrid.training import build_model
    torch.set_num_threads(1)
    cfg = TrainConfig(tensor_model_parallel_size=ps.tp_size, num_layers=a.num_layers,
                      hidden_size=a.hidden_size, num_attention_heads=a.heads,
                      seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                      hidden_dropout=0.1, attention_dropout=0.1, **MODES[mode]
                      ).validate(ps.world_size)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    model = build_model(cfg, ps, a.vocab_size, rng)
    ac = apply_activation_checkpointing(model, ps, rng, cfg) if MODES[mode] else None
    saved = _SavedBytes(list(model.parameters()))
    g = torch.Generator().manual_seed(0)
    times, peak, ckpt_peak = [], 0, 0
    for i in range(a.warmup + a.steps):
        x = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=g)
        model.zero_grad(set_to_none=False)
        t0 = time.perf_counter()

        def watch(t):
            nonlocal peak
            h = saved.pack(t)
            peak = max(peak, saved.now + (ac.stored_bytes() if ac else 0))
            return h
        with torch.autograd.graph.saved_tensors_hooks(watch, saved.unpack):
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        if ac is not None:
            ckpt_peak = max(ckpt_peak, ac.peak_bytes())
    return {"times": times, "peak": peak, "ckpt": ckpt_peak}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--budget-mib", type=float, default=64.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    budget = a.budget_mib * 2**20
    for tp in a.tp:
        results = {m: run_ranks(_bench, tp, tp, args=(m, a), timeout=1200) for m in MODES}
        base = statistics.median(t for r in results["recompute"] for t in r["times"])
        full_ckpt = max(r["ckpt"] for r in results["recompute"])
        for mode, res in results.items():
            med = statistics.median(t for r in res for t in r["times"])
            peak = max(r["peak"] for r in res)
            ckpt = max(r["ckpt"] for r in res)
            per_sample = peak / a.micro_batch_size
            print(json.dumps({
                "tp": tp, "mode": mode, "median_step_s": round(med, 4),
                "ratio_to_recompute": round(med / base, 3),
                "peak_activation_bytes_per_rank": peak, "checkpoint_bytes_per_rank": ckpt,
                "checkpoint_fraction_of_unpartitioned": round(ckpt / full_ckpt, 4)
                if full_ckpt and ckpt else None,
                "bytes_per_sample": int(per_sample),
                "max_micro_batch_in_budget": int(budget // per_sample),
                "budget_mib": a.budget_mib}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
