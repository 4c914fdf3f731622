#!/usr/bin/env python
"""The tail of a pipeline step under ZeRO-Offload: per stage, from its last backward to
its step's end, split into the wait for the other stages and its host step.

    python -m benchmarks.bench_pipeline_offload [--dp 1] [--tiers cpu nvme] [--steps 4]
        [--modes speculate prefetch]

A GPT of ``--layers`` x ``--hidden`` (default 4 x 1024, vocabulary 8192, untied head:
many parameters) at PP 2 x DP ``--dp``, micro-batch 1, sequence ``--seq`` (default 32:
a small batch, so the optimizer step is a visible share), ``--micro-batches`` (default
2), fp32, ZeRO ``--zero-stage`` (default 2), ``--clip-grad`` (default 1.0), the
optimizer on each of ``--tiers`` (host memory, NVMe swap files under ``--nvme-path``),
through the trainer's own :func:`hybrid.train.step.train_step`, in
fresh processes per tier. Per rank and timed step (after one warm-up), read around
that function without changing it:

* ``step_s``: the whole step, from a barrier before it to the end of ``engine.step``;
* ``run_s``: the executor's list, to its ``END``;
* ``tail_s``: from the end of the stage's last backward (the executor's timeline) to
  the end of ``engine.step``;
* ``host_step_s``: of it, the main thread in the host step
  (``engine.offload_seconds()["host_step"]``: the update, its uploads);
* ``wait_s`` = ``tail_s - host_step_s``: the loss all-reduce over the stages, the
  norm's all-reduce and the rest of the step -- on a stage whose backward ends early,
  mostly the other stages' drain, the time an early start of the host step could
  hide at most.

Steps alternate, ABBA, between the two ``--modes`` of what starts when the executor's
list ends (``engine.prefetch_step``): ``speculate``, the step as it is (the nvme tier's
first tiles start off the disk and the worker updates them speculatively: [Note: what
starts before the step] in hybrid/zero/offload/host_step.py); ``prefetch``, the
read-ahead only (the call without the step's ``lr``); ``no_prefetch``, without the call.
The host tier has nothing to prefetch or speculate on, so its columns differ by noise
only. Each mode's rows also count the tiles speculated, used and discarded.

Prints one JSON object: per tier, per stage, per mode the medians over its DP ranks'
steps (and the tile counts summed over them).
A bench asserts nothing about time (benchmarks/timing.py).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from benchmarks.timing import abba, emit, median_of, now
from hybrid.config import Flags, build_config
from hybrid.testing.pool import run_ranks


def _config(a, tier: str, swap_dir: str, world: int):
    return build_config(Flags(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        seq_length=a.seq, max_position_embeddings=a.seq, micro_batch_size=1,
        global_batch_size=a.micro_batches * a.dp, hidden_dropout=0.0, attention_dropout=0.0,
        untie_embeddings_and_output_weights=True, lr=1e-4, weight_decay=0.01,
        clip_grad=a.clip_grad, zero_stage=a.zero_stage, seed=1234,
        pipeline_model_parallel_size=2, offload_optimizer=tier,
        offload_nvme_path=os.path.join(swap_dir, tier) if tier == "nvme" else None), world)


def _rank(ps, tier: str, a, swap_dir: str) -> dict:
    import hybrid.pipeline.step as step_mod
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    from hybrid.train.step import activation_shape, train_step
    torch.set_num_threads(1)
    cfg = _config(a, tier, swap_dir, ps.world_size)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    model, _, engine = build_engine(cfg, ps, a.vocab, rng)
    marks: dict[str, float] = {}
    run_actions, step = step_mod.run_actions, engine.step

    def timed_run(*args, **kw):
        timeline: list = []
        out = run_actions(*args, **kw, timeline=timeline)
        marks["run_end"] = now()
        marks["last_backward_end"] = max(e for act, _, e in timeline
                                         if act.kind.value in ("B", "W"))
        return out

    def timed_step(*args, **kw):
        h0 = engine.offload_seconds()["host_step"]
        out = step(*args, **kw)
        marks["step_end"] = now()
        marks["host_step"] = engine.offload_seconds()["host_step"] - h0
        return out

    step_mod.run_actions = timed_run  # (this process only: fresh per tier)
    engine.step = timed_step
    prefetch = engine.prefetch_step
    modes = {"speculate": prefetch,
             "prefetch": lambda lr=None, grad_divisor=1.0: prefetch(),
             "no_prefetch": lambda lr=None, grad_divisor=1.0: None}
    g = torch.Generator().manual_seed(5 + ps.dp_rank)
    shape = activation_shape(1, a.seq, a.hidden, ps, False)
    rows: list[dict] = []
    try:
        for i in range(1 + a.steps):
            data = torch.randint(0, a.vocab, (a.micro_batches, 1, a.seq + 1), generator=g)
            micro = [(d[:, :-1], d[:, 1:]) for d in data]
            mode = abba(i // 2, *a.modes)[i % 2]  # ABBA: the first mode, the second
            engine.prefetch_step = modes[mode]
            counts = engine.offload_speculation()
            ps.world_group.all_reduce(torch.zeros(1))  # every rank starts together
            t0 = now()
            loss, _, _ = train_step(model, engine, micro, 1e-4, schedule="1f1b", shape=shape,
                                    dtype=torch.float32)
            if i == 0:
                continue
            tail = marks["step_end"] - marks["last_backward_end"]
            after = engine.offload_speculation()
            rows.append({"mode": mode, "step_s": marks["step_end"] - t0,
                         "run_s": marks["run_end"] - t0, "tail_s": tail,
                         "host_step_s": marks["host_step"],
                         "wait_s": tail - marks["host_step"], "loss": float(loss),
                         **{k: v - counts[k] for k, v in after.items()}})
    finally:
        engine.close()
    return {"stage": ps.pp_rank, "rows": rows,
            "params": sum(p.numel() for p in model.parameters())}


def _summary(results: list[dict], modes: list[str]) -> dict:
    out: dict = {}
    for stage in sorted({r["stage"] for r in results}):
        out[f"stage{stage}"] = {
            "params": next(r["params"] for r in results if r["stage"] == stage)}
        for mode in modes:
            rows = [row for r in results if r["stage"] == stage for row in r["rows"]
                    if row["mode"] == mode]
            out[f"stage{stage}"][mode] = {
                **{f"median_{k}": round(median_of(row[k] for row in rows), 4)
                   for k in ("step_s", "run_s", "tail_s", "host_step_s", "wait_s")},
                **{f"{k}_tiles": sum(row[k] for row in rows)
                   for k in ("speculated", "used", "discarded") if k in rows[0]}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=4, help="timed steps, after one warm-up")
    ap.add_argument("--tiers", nargs="+", default=["cpu", "nvme"], choices=["cpu", "nvme"])
    ap.add_argument("--nvme-path", default=os.getcwd())
    ap.add_argument("--modes", nargs=2, default=["speculate", "prefetch"],
                    choices=["speculate", "prefetch", "no_prefetch"],
                    help="the two ways of starting the step that alternate (ABBA)")
    a = ap.parse_args(argv)
    if a.modes[0] == a.modes[1]:
        ap.error("--modes: two different ones")
    record: dict = {"pp": 2, "dp": a.dp, "layers": a.layers, "hidden": a.hidden,
                    "seq": a.seq, "micro_batches": a.micro_batches,
                    "zero_stage": a.zero_stage, "clip_grad": a.clip_grad,
                    "modes": a.modes}
    with tempfile.TemporaryDirectory(dir=a.nvme_path) as swap_dir:
        for tier in a.tiers:
            results = run_ranks(_rank, 2 * a.dp, 1, args=(tier, a, swap_dir), pp=2,
                                timeout=1800, reuse=False)
            record[tier] = _summary(results, a.modes)
    emit(record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
