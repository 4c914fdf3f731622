#!/usr/bin/env python
"""How long a sequence fits a rank's activation budget at each context-parallel size, on CPU.

    python -m benchmarks.bench_context_parallel [--cp 1 2 4] [--comm-type p2p]
        [--budget-bytes 8388608] [--max-seq-length 65536]

For a small fp32 GPT at each CP size C (world = C, one gloo process per rank,
launched by :func:`hybrid.testing.pool.run_ranks`; each rank fed its T / C tokens
in ``--layout``) prints one JSON record:

* ``longest_seq_length``: the longest T on the grid (multiples of 2C load-balanced,
  C striped: doubling from one grid step, then bisecting the last doubling) whose
  ``measured_peak_bytes`` -- the high-water mark of what autograd holds for
  backward over one forward and backward on a rank
  (:class:`hybrid.train.activation_meter.SavedActivationMeter`), the most of any
  CP rank -- fits ``--budget-bytes``; ``next_seq_length`` and its peak: the grid's
  next step, which does not fit (null when ``--max-seq-length`` stopped the search);
* beside it the estimator's (:mod:`hybrid.estimate.memory`): ``predicted_saved_bytes``
  at that T (layers + head: what the meter measures), ``predicted_peak_bytes`` (with
  the transients the meter does not see: the CP attention's blocks and buffers in
  backward, or the logits), and ``predicted_longest_seq_length``, the same search
  on the predicted saved bytes;
* ``median_step_s`` (forward + backward at that T, median over ``--steps`` steps of
  every rank after ``--warmup``) and ``step_s_per_token`` (over the B x T tokens of
  the whole sequence, which the C ranks share);
* ``cp_bytes_per_step``: what one step moved over the CP group, counted by the comm
  door, beside ``predicted_cp_bytes_per_step`` (``traffic_bytes``'s).

Memory is measured on steps apart from the timed ones (the meter's hooks cost
time). With fewer cores than ranks the timings are noisy; nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from typing import Any

import torch

from benchmarks.timing import emit, interleaved, median_of
from hybrid.config.model import ModelConfig
from hybrid.estimate.memory import Workload, activation_bytes, traffic_bytes
from hybrid.testing.pool import run_ranks


def _model_config(a, seq_length: int) -> ModelConfig:
    return ModelConfig(vocab_size=a.vocab_size, num_layers=a.num_layers,
                       hidden_size=a.hidden_size, num_attention_heads=a.heads,
                       ffn_hidden_size=4 * a.hidden_size, seq_length=seq_length,
                       max_position_embeddings=a.max_seq_length, hidden_dropout=0.0,
                       attention_dropout=0.0)


def workload(a, cp: int, seq_length: int) -> Workload:
    """The estimator's view of one rank at CP ``cp`` and sequence length ``seq_length``."""
    return Workload(model=_model_config(a, seq_length), micro_batch_size=a.micro_batch_size,
                    device="cpu", cp=cp, cp_comm_type=a.comm_type, cp_layout=a.layout)


def grid_step(a, cp: int) -> int:
    """The sequence lengths a CP size can split: multiples of this."""
    return 2 * cp if a.layout == "load_balanced" else cp


def longest_fitting(fits, step: int, limit: int) -> tuple[int | None, int | None]:
    """(the longest multiple of ``step`` up to ``limit`` with ``fits(T)``, the shortest
    one above it that does not fit -- None when ``limit`` ended the search): double
    from ``step``, then bisect the last doubling. ``fits`` must be monotone (bytes
    grow with T); it is called O(log(limit / step)) times."""
    if step > limit or not fits(step):
        return None, step
    lo, hi = step, None
    while hi is None:
        if 2 * lo <= limit:
            lo, hi = (2 * lo, None) if fits(2 * lo) else (lo, 2 * lo)
            continue
        top = limit // step * step
        if top == lo or fits(top):
            return top, None
        hi = top
    while hi - lo > step:  # lo fits, hi does not
        mid = lo + (hi - lo) // step // 2 * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


def _batch(a, ps, seq: int):
    from hybrid.tensor_parallel.context_parallel import cp_shard
    g = torch.Generator().manual_seed(seq)
    batch = torch.randint(0, a.vocab_size, (a.micro_batch_size, seq + 1), generator=g)
    # two tensors of their own, as the estimator counts them (and as cp_shard cuts them)
    tokens, labels = batch[:, :-1].clone(), batch[:, 1:].clone()
    if ps.cp_size > 1:
        tokens, labels = (cp_shard(x, 1, ps.cp_size, ps.cp_rank, a.layout)
                          for x in (tokens, labels))
    return tokens, labels


def _bench(ps, a):
    """On every rank: the search (each probe's peak the most over the CP group, so all
    ranks walk the same grid), then the timed steps at the longest fitting T."""
    import torch.distributed as dist

    from hybrid.tensor_parallel import seed_all
    from hybrid.tensor_parallel.cp_attention import ContextParallel
    from hybrid.train.activation_meter import SavedActivationMeter
    from models.gpt import GPT
    torch.set_num_threads(1)
    rng = seed_all(1234, ps.tp_rank, ps.dp_rank, ps.device)
    cp = (ContextParallel(ps.cp_group, a.comm_type, a.layout) if ps.cp_size > 1 else None)
    model = GPT(_model_config(a, a.max_seq_length).with_vocab_size(a.vocab_size), ps.tp_group,
                rng=rng, seed=1234, context_parallel=cp)
    model.train()
    peaks = {}

    def step(seq, meter=None):
        tokens, labels = _batch(a, ps, seq)
        model.zero_grad(set_to_none=False)
        with meter if meter is not None else contextlib.nullcontext():
            model(tokens, labels).backward()

    def fits(seq):
        meter = SavedActivationMeter()
        step(seq, meter)
        most = torch.tensor([float(meter.peak)], dtype=torch.float64)
        ps.cp_group.all_reduce(most, op=dist.ReduceOp.MAX)
        peaks[seq] = int(most.item())
        return peaks[seq] <= a.budget_bytes

    best, nxt = longest_fitting(fits, grid_step(a, ps.cp_size), a.max_seq_length)
    out: dict[str, Any] = {"longest": best, "next": nxt, "peaks": peaks, "times": []}
    if best is None:
        return out
    out["times"] = interleaved({"step": functools.partial(step, best)}, a.steps, a.warmup)["step"]
    ps.comm_stats.reset()
    step(best)
    out["moved"] = ps.comm_stats.snapshot()
    return out


def _record(a, cp: int, ranks: list[dict], cp1_longest: int | None) -> dict:
    """One JSON record: rank 0's search (every rank walked the same) beside the estimate."""
    r = ranks[0]
    best, nxt = r["longest"], r["next"]
    step = grid_step(a, cp)

    def predicted_fits(seq):
        acts = activation_bytes(workload(a, cp, seq))
        return acts["layers"] + acts["head"] <= a.budget_bytes

    predicted_best, _ = longest_fitting(predicted_fits, step, a.max_seq_length)
    rec = {"cp": cp, "comm_type": a.comm_type, "layout": a.layout, "world_size": cp,
           "layers": a.num_layers, "hidden_size": a.hidden_size, "heads": a.heads,
           "vocab_size": a.vocab_size, "micro_batch_size": a.micro_batch_size,
           "dtype": "fp32", "budget_bytes": a.budget_bytes,
           "longest_seq_length": best, "tokens_per_rank": None if best is None else best // cp,
           "measured_peak_bytes": None if best is None else r["peaks"][best]}
    if best is not None:
        w = workload(a, cp, best)
        acts = activation_bytes(w)
        times = [t for rank in ranks for t in rank["times"]]
        med = median_of(times)
        predicted_cp = traffic_bytes(w).get("cp_bytes_per_step", {"total": 0})
        rec.update(predicted_saved_bytes=acts["layers"] + acts["head"],
                   predicted_peak_bytes=acts["peak"],
                   cp_attention_working_set_bytes=acts.get("cp_attention_working_set", 0),
                   predicted_longest_seq_length=predicted_best,
                   next_seq_length=nxt,
                   next_measured_peak_bytes=None if nxt is None else r["peaks"][nxt],
                   median_step_s=round(med, 4),
                   step_s_per_token=float(f"{med / (a.micro_batch_size * best):.4g}"),
                   seq_length_vs_cp1=(round(best / cp1_longest, 3) if cp1_longest else None),
                   cp_bytes_per_step=sum(r["moved"].values()),
                   predicted_cp_bytes_per_step=predicted_cp["total"])
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--comm-type", choices=("p2p", "all_gather", "a2a"), default="p2p")
    ap.add_argument("--layout", choices=("load_balanced", "striped"), default="load_balanced")
    ap.add_argument("--budget-bytes", type=int, default=8 * 2**20,
                    help="activation bytes one rank may hold for backward")
    ap.add_argument("--max-seq-length", type=int, default=65536,
                    help="stop the search here (the position table's size)")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    if a.comm_type == "a2a" and any(a.heads % c for c in a.cp):
        ap.error(f"--comm-type a2a splits the {a.heads} heads over CP: every --cp must divide them")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cp1_longest = None
    for cp in a.cp:
        ranks = run_ranks(_bench, world_size=cp, cp=cp, args=(a,), timeout=3600)
        rec = _record(a, cp, ranks, cp1_longest)
        if cp == 1:
            cp1_longest = rec["longest_seq_length"]
        emit(rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
