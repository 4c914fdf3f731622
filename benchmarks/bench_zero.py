#!/usr/bin/env python
"""hybrid's ZeRO stages against the peers a user would pick instead, on CPU.

    python -m benchmarks.bench_zero [--world-size 2] [--rounds 2] [--steps 8]

Same GPT (hybrid's, TP=1), same seed, same synthetic token batches, same world
size for every system: torch DDP, torch ZeroRedundancyOptimizer, torch FSDP2
(``fully_shard`` per block), hybrid ZeRO stages 0-3, and DeepSpeed ZeRO 1-3
when ``deepspeed`` imports. Systems run in fresh processes, alternating
round by round (this machine's timings drift by +-20%), and each run reports
the median of its timed steps after warm-up. One JSON record per system:
median step time, ratio to DDP, peak RSS per rank, model-state bytes per rank,
bytes communicated per step per rank (measured by hybrid's counters for
hybrid; the ring-algorithm volume of the peers' known schedule otherwise,
marked as such).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from benchmarks.timing import Stopwatch, emit, median_of, peak_rss_mb
from hybrid.config import Flags, build_config
from hybrid.testing.pool import run_ranks

PEERS = ["ddp", "zero_redundancy", "fsdp2"]
HYBRID = [f"hybrid_stage{s}" for s in range(4)]
DEEPSPEED = [f"deepspeed_stage{s}" for s in (1, 2, 3)]


def _tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's shard
        total += local.numel() * local.element_size()
    return total


def _optimizer_state_bytes(opt) -> int:
    return _tensor_bytes(v for st in opt.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor) and v.numel() > 1)


def _build(a, ps):
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_model
    cfg = build_config(Flags(num_layers=a.num_layers, hidden_size=a.hidden_size,
                      num_attention_heads=a.heads, seq_length=a.seq_length,
                      micro_batch_size=a.micro_batch_size, hidden_dropout=0.0,
                      attention_dropout=0.0, lr=1e-4, weight_decay=0.01, clip_grad=1.0,
                      make_vocab_size_divisible_by=128, reduce_bucket_size=a.bucket_size,
                      allgather_bucket_size=a.bucket_size, overlap_comm=True,
                      zero_param_persistence_threshold=0, seed=1234), ps.world_size)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    return cfg, build_model(cfg, ps, a.vocab_size, rng)


def _batches(a, ps, n):
    g = torch.Generator().manual_seed(100 + ps.dp_rank)
    return [torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length + 1), generator=g)
            for _ in range(n)]


def _ring_bytes(psi: int, n: int, passes: int) -> float:
    """Bytes per rank of ``passes`` ring collectives over ``psi`` fp32 values on ``n`` ranks."""
    return passes * psi * 4 * (n - 1) / n


def _hybrid_setup(system, cfg, model, ps):
    """(step, model-state bytes): hybrid's ZeRO stage ``system[-1]``."""
    from hybrid.zero import apply_zero
    engine = apply_zero(model, ps, dataclasses.replace(cfg.zero, stage=int(system[-1])),
                        adamw=cfg.adamw, precision=cfg.precision, offload=cfg.offload)

    def step(b):
        engine.zero_grad()
        engine.backward(model(b[:, :-1], b[:, 1:]))
        engine.step(cfg.lr_schedule.lr)
    return step, engine.model_state_bytes


def _deepspeed_setup(system, a, model, psi, n):
    """(step, ring bytes of its schedule): DeepSpeed ZeRO stage ``system[-1]``."""
    import deepspeed
    import torch.distributed as dist
    # DeepSpeed reads its launcher's LOCAL_RANK; these pool ranks are one machine's
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    stage = int(system[-1])
    ds_cfg = {"train_micro_batch_size_per_gpu": a.micro_batch_size,
              "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "overlap_comm": True,
                                    "reduce_bucket_size": a.bucket_size,
                                    "allgather_bucket_size": a.bucket_size,
                                    "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01,
                                                       "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_cfg,
                                           model_parameters=model.parameters())

    def step(b):
        loss = engine(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step()
    return step, _ring_bytes(psi, n, 3 if stage == 3 else 2)


def _torch_setup(system, a, model, psi, n):
    """(step, model-state bytes, ring bytes of its schedule): torch's DDP, FSDP2 or
    ZeroRedundancyOptimizer."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    comm = _ring_bytes(psi, n, 2)
    if system == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
        comm = _ring_bytes(psi, n, 3)
    else:
        wrapped = DDP(model, bucket_cap_mb=a.bucket_size * 4 / 2**20)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    opt: torch.optim.Optimizer
    zero = None
    if system == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = zero = ZeroRedundancyOptimizer(list(model.parameters()), torch.optim.AdamW,
                                             lr=1e-4, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-4)

    def step(b):
        opt.zero_grad(set_to_none=False)
        wrapped(b[:, :-1], b[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def states():
        inner = zero.optim if zero is not None else opt  # (ZeRO: this rank's own)
        p = _tensor_bytes(model.parameters())
        g = _tensor_bytes(q.grad for q in model.parameters())
        o = _optimizer_state_bytes(inner)
        return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}
    return step, states, comm


def _bench_rank(ps, system, a):
    """One rank's run of ``system``: step times after warm-up, peak RSS, model-state
    bytes, and bytes communicated per step (hybrid's counters for hybrid, the ring
    volume of the peers' known schedule otherwise)."""
    torch.set_num_threads(1)
    base_rss = peak_rss_mb()
    cfg, model = _build(a, ps)
    psi = sum(p.numel() for p in model.parameters())
    n = ps.dp_size
    states, comm = None, None  # comm None: measured by hybrid's counters
    if system.startswith("hybrid"):
        step, states = _hybrid_setup(system, cfg, model, ps)
    elif system.startswith("deepspeed"):
        step, comm = _deepspeed_setup(system, a, model, psi, n)
    else:
        step, states, comm = _torch_setup(system, a, model, psi, n)
    batches = _batches(a, ps, a.warmup + a.steps)
    times = []
    for i, b in enumerate(batches):
        if i == a.warmup:
            ps.comm_stats.reset()
        with Stopwatch() as sw:
            step(b)
        if i >= a.warmup:
            times.append(sw.seconds)
    measured = sum(ps.comm_stats.snapshot().values()) / a.steps
    return {"times": times, "peak_rss_mb": peak_rss_mb(), "base_rss_mb": base_rss,
            "model_state_bytes": states() if states else None, "psi": psi,
            "comm_bytes_per_step": measured if comm is None else comm,
            "comm_bytes_source": "measured" if comm is None else "theory"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--bucket-size", type=int, default=2_000_000, help="elements")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--systems", nargs="+", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    systems = a.systems or PEERS + HYBRID + DEEPSPEED
    try:
        import deepspeed  # noqa: F401
        have_ds = True
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        have_ds, ds_error = False, f"{type(e).__name__}: {e}"
    runs: dict[str, list] = {s: [] for s in systems}
    for _ in range(a.rounds):  # alternate systems so drift hits all of them alike
        for s in systems:
            if s.startswith("deepspeed") and not have_ds:
                continue
            if s.startswith("deepspeed"):
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            # fresh processes (reuse=False): peak RSS is over a process's whole life
            runs[s].append(run_ranks(_bench_rank, a.world_size, 1, args=(s, a), timeout=900,
                                     reuse=False))
    ddp_median: float | None = None
    for s in systems:
        if not runs[s]:
            emit({"system": s, "skipped": f"deepspeed not importable ({ds_error})"})
            continue
        times = [t for r in runs[s] for rank in r for t in rank["times"]]
        med = median_of(times)
        if s == "ddp":
            ddp_median = med
        last = runs[s][-1]
        emit({
            "system": s, "world_size": a.world_size, "params": last[0]["psi"],
            "median_step_s": round(med, 4),
            "ratio_to_ddp": round(med / ddp_median, 3) if ddp_median else None,
            "peak_rss_mb_per_rank": [round(r["peak_rss_mb"], 1) for r in last],
            "rss_above_import_mb_per_rank": [round(r["peak_rss_mb"] - r["base_rss_mb"], 1)
                                             for r in last],
            "model_state_bytes": last[0]["model_state_bytes"],
            "comm_bytes_per_step": int(last[0]["comm_bytes_per_step"]),
            "comm_bytes_source": last[0]["comm_bytes_source"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
