#!/usr/bin/env python
"""Training-step throughput of one rank: MFU, tokens/s, peak memory, host syncs per step.

    python -m benchmarks.bench_throughput                    # GPU: the 1.3B-class shape
    python -m benchmarks.bench_throughput --preset tiny      # CPU: a 2-layer model, seconds
    python -m benchmarks.bench_throughput --configs zero2 zero2_offload --steps 20
    torchrun --nproc-per-node 8 -m benchmarks.bench_throughput   # one line per config, rank 0

Presets: ``1.3b``, the shape the GPU throughput is measured at, is 24 layers x
2048 hidden x 16 heads, seq 2048, micro-batch 4, bf16, GPT-2's vocabulary;
``tiny`` is 2 x 64 x 4, seq 32, micro 2, for checking the script on a CPU. Each
config builds the model exactly as training does
(``hybrid.train.setup.build_engine``: meta device, ZeRO materializes its shard)
and runs ``train_step`` on synthetic tokens already on the device, so the data
pipeline is not measured.

Per config one JSON line: median step time over the timed steps (wall time
between device syncs), tokens/s per rank, MFU (model FLOPs per token x
tokens/s / ``--peak-tflops``; None on a CPU), peak memory (max_memory_allocated
on a GPU, max RSS on a CPU) and host syncs per step -- counted over a few
extra steps by torch's sync debug mode on a GPU (the synchronizing calls torch
reports: stream/device synchronizations, blocking copies, value reads), by
Python-level value reads on a CPU (:mod:`hybrid.testing.host_syncs`).

Configs: ``zero2`` (ZeRO-2, bf16), ``zero2_offload`` (+ --offload-optimizer),
``zero2_offload_delayed`` (+ --offload-delayed-update), ``zero3`` (ZeRO-3).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks.timing import emit, interleaved, median_of, peak_rss_mb
from hybrid.config import Flags, build_config
from hybrid.testing.host_syncs import HostReads, cuda_syncs

PRESETS: dict[str, dict[str, Any]] = {  # Flags' fields, and the vocabulary
    "1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                 micro_batch_size=4, vocab=50257),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                 micro_batch_size=2, vocab=257),
}
CONFIGS: dict[str, dict[str, Any]] = {  # Flags' fields
    "zero2": dict(zero_stage=2),
    "zero2_offload": dict(zero_stage=2, offload_optimizer="cpu"),
    "zero2_offload_delayed": dict(zero_stage=2, offload_optimizer="cpu",
                                  offload_delayed_update=True),
    "zero3": dict(zero_stage=3),
}


def _parallel_state():
    """Under torchrun: this rank's groups (TP 1, all ranks DP); alone: one process
    on the GPU, or the CPU."""
    from hybrid.parallel.state import init_distributed
    return init_distributed(1)


def _peak_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return int(peak_rss_mb() * 2**20)


def run_config(name: str, a, ps) -> dict:
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    from hybrid.train.step import train_step

    shape = dict(PRESETS[a.preset])
    vocab = shape.pop("vocab")
    flags = Flags(**shape, bf16=not a.fp32, hidden_dropout=0.0, attention_dropout=0.0,
                  lr=1e-4, seed=1234, reduce_bucket_size=a.bucket_size,
                  allgather_bucket_size=a.bucket_size, overlap_comm=True,
                  global_batch_size=shape["micro_batch_size"] * ps.dp_size * a.micro_batches,
                  compile=a.compile, **CONFIGS[name])
    cfg = build_config(flags, ps.world_size)
    if ps.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ps.device)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    model, _, engine = build_engine(cfg, ps, vocab, rng)
    g = torch.Generator().manual_seed(7 + ps.dp_rank)
    micro, seq = cfg.loop.micro_batch_size, cfg.model.seq_length
    data = [torch.randint(0, vocab, (micro, seq + 1), generator=g).to(ps.device)
            for _ in range(a.micro_batches)]
    batches = [(b[:, :-1], b[:, 1:]) for b in data]
    lr = cfg.lr_schedule.lr
    # the device synced around each step: timing, not training
    times = interleaved({name: lambda: train_step(model, engine, batches, lr)}, a.steps,
                        a.warmup, device=ps.device)[name]
    counter = cuda_syncs() if ps.device.type == "cuda" else HostReads()
    with counter as syncs:
        for _ in range(a.sync_steps):
            train_step(model, engine, batches, lr)
    step_s = median_of(times)
    tokens = micro * seq * a.micro_batches
    flops = model.cfg.flops_per_token(ps.tp_size) * tokens / step_s
    engine.wait_optimizer()
    return {"config": name + ("+compile" if a.compile else ""), "preset": a.preset,
            "device": str(ps.device), "world_size": ps.world_size,
            "params": model.cfg.num_parameters(ps.tp_size, per_rank=False),
            "median_step_s": round(step_s, 5), "tokens_per_s_per_rank": round(tokens / step_s, 1),
            "tflops_per_rank": round(flops / 1e12, 3),
            "mfu": (round(flops / (a.peak_tflops * 1e12), 4)
                    if a.peak_tflops and ps.device.type == "cuda" else None),
            "peak_memory_bytes": _peak_bytes(ps.device),
            "host_syncs_per_step": syncs.count / max(1, a.sync_steps),
            "sync_counter": "cuda sync debug mode" if ps.device.type == "cuda"
            else "python value reads"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="default: 1.3b with a GPU, tiny without")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS),
                    default=["zero2", "zero2_offload"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sync-steps", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=1, help="per step (accumulation)")
    ap.add_argument("--bucket-size", type=int, default=50_000_000)
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="the GPU's dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--fp32", action="store_true", help="fp32 instead of bf16")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block")
    a = ap.parse_args(argv)
    if a.preset is None:
        a.preset = "1.3b" if torch.cuda.is_available() else "tiny"
    ps = _parallel_state()
    for name in a.configs:
        res = run_config(name, a, ps)
        if ps.rank == 0:
            emit(res)
        if ps.device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
