"""What one rank of a TP section's torchrun launch does (``bench_peers.py --worker``): one
system (``hybrid`` or ``megatron``), or both in turn (``inprocess``), on the same synthetic
batches; rank 0 prints one line, ``RESULT_TAG`` and a JSON object, for the parent."""

from __future__ import annotations

import json
import os
import time
from time import perf_counter
from typing import Any

from benchmarks.peers.blocked import BlockedClock, per_step
from benchmarks.peers.common import LAUNCH_ENV, RESULT_TAG, TP_SHAPE
from benchmarks.peers.hybrid_side import HybridSide, import_hybrid
from benchmarks.peers.megatron_side import (
    MegatronSide,
    import_megatron,
    init_megatron_groups,
    patch_megatron_for_cpu,
)
from benchmarks.timing import Stopwatch, abba, median, rnd


def synthetic(shape: dict, n: int, seed: int):
    """``n`` (tokens, labels) batches of uniform token ids, the same on every rank and
    for both systems."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        b = torch.randint(0, shape["vocab"], (shape["micro"], shape["seq_length"] + 1),
                          generator=g)
        out.append((b[:, :-1].contiguous(), b[:, 1:].contiguous()))
    return out


def max_over_ranks(values: list[float]) -> list[float]:
    """Per entry, the slowest rank's value (a step ends when its last rank does)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and len(values):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed_steps(side, batches, n: int, start: int = 0, clock=None):
    times, losses = [], []
    for i in range(start, start + n):
        x, y = batches[i % len(batches)]
        if clock is not None:
            clock.begin_step()
        with Stopwatch() as sw:
            losses.append(side.step(x, y))
        times.append(sw.seconds)
    return times, losses


def timed_evals(side, batches, n: int):
    times, loss = [], None
    for _ in range(n):
        with Stopwatch() as sw:
            loss = side.evaluate(batches)
        times.append(sw.seconds)
    return times, loss


def params(model) -> int:
    """Parameters this rank holds (its TP slices and the replicated ones)."""
    return sum(p.numel() for p in model.parameters())


def since_launch() -> float | None:
    t = os.environ.get(LAUNCH_ENV)
    return time.time() - float(t) if t else None


def _import_libraries(kind: str) -> dict:
    """Import (and for megatron-core, patch) what ``kind`` runs; seconds per library."""
    t0 = perf_counter()
    imports = {}
    if kind in ("megatron", "inprocess"):
        patch_megatron_for_cpu()
        import_megatron()
        imports["megatron"] = rnd(perf_counter() - t0, 3)
    if kind in ("hybrid", "inprocess"):
        t = perf_counter()
        import_hybrid()
        imports["hybrid"] = rnd(perf_counter() - t, 3)
    return imports


def _init_groups(kind: str, tp: int):
    """The process groups of ``kind``; hybrid's ParallelState, or None for megatron alone."""
    import torch.distributed as dist
    if kind == "megatron":
        dist.init_process_group("gloo")
        init_megatron_groups(tp)
        return None
    from hybrid.parallel.state import init_distributed
    ps = init_distributed(tp)
    if kind == "inprocess":
        init_megatron_groups(tp)
    return ps


def _build(kind: str, a, ps, shape: dict):
    t = perf_counter()
    side = HybridSide(ps, shape, a.zero_stage) if kind == "hybrid" else MegatronSide(a.tp, shape)
    return side, perf_counter() - t


def _run_one(a, ps, shape: dict, train, evals, clock: BlockedClock | None = None) -> dict:
    """One system: build it, step it, evaluate it; with ``clock`` (``--blocked``), the
    time its timed steps spent blocked in collectives."""
    out: dict[str, Any] = {}  # the JSON record
    side, build_s = _build(a.worker, a, ps, shape)
    out["build_s"] = rnd(build_s, 3)
    out["params_per_rank"] = params(side.model)
    out["startup_s"] = rnd(since_launch(), 3)  # launch -> the first iteration starts
    times, losses = timed_steps(side, train, a.warmup)
    if clock is not None:
        clock.take()  # (warm-up and set-up left out)
    more, more_losses = timed_steps(side, train, a.steps, start=a.warmup, clock=clock)
    if clock is not None:
        out["blocked"] = per_step(*clock.take(), a.steps)
    times, losses = max_over_ranks(times + more)[a.warmup:], losses + more_losses
    ev_times, ev_loss = timed_evals(side, evals, a.eval_repeats)
    ev_times = max_over_ranks(ev_times)
    out.update(step_s=rnd(median(times)), step_times_s=[rnd(t) for t in times],
               eval_s=rnd(median(ev_times)), eval_times_s=[rnd(t) for t in ev_times],
               first_loss=rnd(float(losses[0]), 4), last_loss=rnd(float(losses[-1]), 4),
               eval_loss=rnd(ev_loss, 4))
    if hasattr(side, "close"):
        side.close()
    return out


def _run_inprocess(a, ps, shape: dict, train, evals,
                   clock: BlockedClock | None = None) -> dict:
    """Both models on these ranks, stepped alternately (ABBA), each step timed (and
    with ``clock``, its time blocked in collectives)."""
    out: dict[str, Any] = {}  # the JSON record
    sides = {}
    for kind in ("hybrid", "megatron"):
        sides[kind], build_s = _build(kind, a, ps, shape)
        out[f"{kind}_build_s"] = rnd(build_s, 3)
        out[f"{kind}_params_per_rank"] = params(sides[kind].model)
    order = []
    for p in range(a.warmup + a.steps):  # ABBA: pair p is (H, M) or (M, H)
        order += abba(p, "hybrid", "megatron")
    times: dict[str, list[float]] = {k: [] for k in sides}
    losses: dict[str, list] = {k: [] for k in sides}
    it = {k: 0 for k in sides}
    # (seconds, calls) of the timed steps
    blocked: dict[str, tuple[dict, dict]] = {k: ({}, {}) for k in sides}
    if clock is not None:
        clock.take()
    for kind in order:
        x, y = train[it[kind] % len(train)]
        it[kind] += 1
        if clock is not None:
            clock.begin_step()
        with Stopwatch() as sw:
            losses[kind].append(sides[kind].step(x, y))
        times[kind].append(sw.seconds)
        if clock is not None:
            for total, part in zip(blocked[kind], clock.take()):
                if it[kind] > a.warmup:
                    for key, v in part.items():
                        total[key] = total.get(key, 0) + v
    ev: dict[str, list[float]] = {k: [] for k in sides}
    ev_loss: dict[str, float] = {}
    for p in range(a.eval_repeats):
        for kind in abba(p, "hybrid", "megatron"):
            tt, ev_loss[kind] = timed_evals(sides[kind], evals, 1)
            ev[kind] += tt
    for kind in sides:
        st = max_over_ranks(times[kind])[a.warmup:]
        et = max_over_ranks(ev[kind])
        out[kind] = {"step_s": rnd(median(st)), "step_times_s": [rnd(t) for t in st],
                     "eval_s": rnd(median(et)), "eval_times_s": [rnd(t) for t in et],
                     "first_loss": rnd(float(losses[kind][0]), 4),
                     "last_loss": rnd(float(losses[kind][-1]), 4),
                     "eval_loss": rnd(ev_loss[kind], 4)}
        if clock is not None:
            out[kind]["blocked"] = per_step(*blocked[kind], a.steps)
    # per-pair ratios: step i of each system ran next to each other
    h, m = out["hybrid"]["step_times_s"], out["megatron"]["step_times_s"]
    out["pair_ratios"] = [rnd(x / y, 4) for x, y in zip(h, m)]
    sides["hybrid"].close()
    return out


def worker(a) -> int:
    """One system (``hybrid`` or ``megatron``), or both in turn (``inprocess``), on the
    ranks of this torchrun launch; rank 0 prints one tagged JSON line."""
    t_enter = perf_counter()
    import torch
    import torch.distributed as dist
    t_torch = perf_counter()
    torch.set_num_threads(1)
    # before any system is imported: see [Note: installed before the systems import]
    clock = BlockedClock().install() if a.blocked else None
    shape = dict(TP_SHAPE)
    imports = _import_libraries(a.worker)
    t0 = perf_counter()
    ps = _init_groups(a.worker, a.tp)
    groups_s = perf_counter() - t0
    rank = dist.get_rank()
    train = synthetic(shape, 4, seed=7)
    evals = synthetic(shape, a.eval_iters, seed=8)
    out = {"worker": a.worker, "world_size": dist.get_world_size(), "tp": a.tp,
           "torch_import_s": rnd(t_torch - t_enter, 3), "imports_s": imports,
           "process_groups_s": rnd(groups_s, 3)}
    run = _run_one if a.worker in ("hybrid", "megatron") else _run_inprocess
    out.update(run(a, ps, shape, train, evals, clock))
    dist.barrier()
    if rank == 0:
        print(RESULT_TAG + json.dumps(out), flush=True)
    if ps is not None:
        ps.close()
    dist.destroy_process_group()
    return 0
