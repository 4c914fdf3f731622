#!/usr/bin/env python
"""Activation memory and step time of the ZeRO-R checkpointing modes, on CPU.

    python scripts/bench_activations.py [--tp 2 4] [--budget-bytes 268435456]

For a GPT at each TP size (world = TP, one gloo process per rank, launched by
:func:`hybrid.multiprocess.run_ranks`) and each mode -- none, recompute,
recompute+partition, recompute+partition+cpu -- prints one JSON record:

* ``checkpoint_bytes_per_rank``: peak bytes of stored checkpoints in a step
  (:meth:`ActivationCheckpointing.peak_bytes`); 0 for none;
* ``checkpoint_fraction_of_unpartitioned``: that over plain recompute's (the
  issue's target: <= 1/TP + 5%);
* ``buffer_bytes_per_rank``: the gather/staging buffers, allocated once;
* ``peak_activation_bytes_per_rank``: high-water mark of everything autograd
  holds for backward (unique non-parameter storages, via saved_tensors_hooks;
  recompute's one re-run block included) plus the stored checkpoints;
* ``median_step_s`` (forward + backward, median over ``--steps`` steps of every
  rank after ``--warmup``; modes interleaved step by step, so the machine's
  drift hits all alike) and its ratio to plain recompute (target for
  partitioning: <= 1.10);
* ``max_micro_batch_in_budget``: ``--budget-bytes // bytes_per_sample``, with
  bytes per sample = peak activation bytes / ``--micro-batch-size``.

Memory is measured on a separate step from the timed ones (the hooks cost time).
Timings on a machine with fewer cores than ranks are noisy; nothing is asserted.
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

MODES = {"none": None,
         "recompute": {},
         "recompute+partition": {"partition_activations": True},
         "recompute+partition+cpu": {"partition_activations": True, "cpu_checkpointing": True}}


class _SavedBytes:
    """High-water mark of the bytes autograd holds for backward (non-parameter storages).

    Use as ``saved_tensors_hooks(sb.pack, sb.unpack)``; a storage counts once
    however many saved tensors view it, until the last of them is freed.
    """

    def __init__(self, params, extra=lambda: 0):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.extra = extra  # bytes held outside autograd (stored checkpoints)
        self.live: dict[int, list] = {}  # storage ptr -> [bytes, references]
        self.now = self.peak = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs:
            return t
        entry = self.live.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
        entry[1] += 1
        self.peak = max(self.peak, self.now + self.extra())
        return _Held(t, ptr, self)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def drop(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]


class _Held:
    """A saved tensor whose release (when autograd frees it) updates the count."""

    def __init__(self, t, ptr, owner):
        self.t, self.ptr, self.owner = t, ptr, owner

    def __del__(self):
        self.owner.drop(self.ptr)


def _bench(ps, a):
    from hybrid.activation_checkpointing import apply_activation_checkpointing
    from hybrid.config import TrainConfig
    from hybrid.tensor_parallel import seed_all
    from models.gpt import GPT, GPTConfig
    torch.set_num_threads(1)
    gcfg = GPTConfig(vocab_size=a.vocab_size, padded_vocab_size=a.vocab_size,
                     num_layers=a.num_layers, hidden_size=a.hidden_size,
                     num_attention_heads=a.heads, max_position_embeddings=a.seq_length,
                     hidden_dropout=0.1, attention_dropout=0.1)
    runs = {}
    for mode, flags in MODES.items():
        rng = seed_all(1234, ps.tp_rank, ps.dp_rank, ps.device)
        model = GPT(gcfg, ps.tp_group, rng=rng, seed=1234)
        model.train()
        ac = None
        if flags is not None:
            cfg = TrainConfig(tensor_model_parallel_size=ps.tp_size, num_layers=a.num_layers,
                              hidden_size=a.hidden_size, num_attention_heads=a.heads,
                              seq_length=a.seq_length, recompute_activations=True, **flags
                              ).validate(ps.world_size)
            ac = apply_activation_checkpointing(model, ps, rng, cfg.recompute)
        runs[mode] = {"model": model, "ac": ac, "times": []}
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=g)
    tokens, labels = batch[:, :-1], batch[:, 1:]

    def step(r):
        r["model"].zero_grad(set_to_none=False)
        r["model"](tokens, labels).backward()

    for i in range(a.warmup + a.steps):
        for r in runs.values():  # interleaved: drift hits every mode alike
            t0 = time.perf_counter()
            step(r)
            if i >= a.warmup:
                r["times"].append(time.perf_counter() - t0)
    out = {}
    for mode, r in runs.items():
        ac = r["ac"]
        sb = _SavedBytes(r["model"].parameters(), ac.stored_bytes if ac else (lambda: 0))
        if ac is not None:
            ac.reset_peak()
        with torch.autograd.graph.saved_tensors_hooks(sb.pack, sb.unpack):
            step(r)
        out[mode] = {"times": r["times"], "peak": sb.peak,
                     "ckpt": ac.peak_bytes() if ac else 0,
                     "buffers": ac.buffer_bytes() if ac else 0}
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
    ap.add_argument("--budget-bytes", type=int, default=256 * 2**20,
                    help="per-rank activation memory budget for max_micro_batch_in_budget")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for tp in a.tp:
        ranks = run_ranks(_bench, tp, tp, args=(a,), timeout=1800)
        med = {m: statistics.median(t for r in ranks for t in r[m]["times"]) for m in MODES}
        full_ckpt = max(r["recompute"]["ckpt"] for r in ranks)
        for mode in MODES:
            peak = max(r[mode]["peak"] for r in ranks)
            ckpt = max(r[mode]["ckpt"] for r in ranks)
            per_sample = peak / a.micro_batch_size
            print(json.dumps({
                "tp": tp, "mode": mode, "layers": a.num_layers,
                "micro_batch_size": a.micro_batch_size, "seq_length": a.seq_length,
                "hidden_size": a.hidden_size,
                "median_step_s": round(med[mode], 4),
                "step_time_ratio_to_recompute": round(med[mode] / med["recompute"], 3),
                "checkpoint_bytes_per_rank": ckpt,
                "checkpoint_fraction_of_unpartitioned":
                    round(ckpt / full_ckpt, 4) if ckpt else None,
                "buffer_bytes_per_rank": max(r[mode]["buffers"] for r in ranks),
                "peak_activation_bytes_per_rank": peak,
                "bytes_per_sample": int(per_sample),
                "budget_bytes": a.budget_bytes,
                "max_micro_batch_in_budget": int(a.budget_bytes // per_sample)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
