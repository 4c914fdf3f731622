#!/usr/bin/env python
"""One process as the last rank of a 64- and a 1,024-rank MoE run (DeepSeek-V3's layout,
EP 64 x PP 16, at the larger): set-up and step.

    python -m benchmarks.bench_moe_scale [--zero-stage 1] [--rounds 5] [--steps 3]

The process joins torch's fake process group (every collective and every send returns
at once; a receive leaves its buffer as it was) as rank ``world - 1`` of PP 16 x DP
``world / 16`` with the experts over EP = DP: world 64 is EP 4, world 1,024 EP 64. Each
MoE layer has one expert per EP rank (``--num-experts`` = EP), so a rank holds and
computes the same at either world and what grows with the world (the groups' rank
lists, the router's width, the exchange's splits) is what the ratio shows. Set-up is
the default group, this rank's groups (:meth:`hybrid.parallel.state.ParallelState.build`:
its own group of each kind, the expert ones included) and its stage's model under ZeRO
(:func:`hybrid.train.setup.build_engine`); a step is
:func:`hybrid.train.step.train_step` under 1F1B over 16 micro-batches.

The fake group's all-to-alls are made symmetric: what a rank receives is what it sends
(every EP peer routing as this rank does), so the split sizes agree; a received
activation is normal values from one seeded generator (zeros would send every token to
the same experts). The model is
small (one MoE layer a stage, hidden 128, sequence 16, micro-batch 1; 2 experts a token)
but the layout is the real one.

One record per world size, then a summary: the median set-up and step seconds over
``--rounds`` (ABBA), the model-state bytes this rank holds
(:meth:`ZeroEngine.model_state_bytes`) beside the estimator's
(:func:`hybrid.estimate.memory.peak_memory`'s model states for this stage, experts over
EDP), and the all-to-all bytes a step sends beside
:func:`hybrid.estimate.memory.expert_exchange_bytes` (uniform routing; the routed truth
of random tokens is near it). Nothing is asserted about time;
``tests/models/test_moe_scale.py`` holds the byte figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.fake_rank import (
    VOCAB,
    abba,
    fake_world,
    filled_receives,
    machine,
    scale_args,
    timed_steps,
)
from benchmarks.timing import emit
from hybrid.config import build_config, parse_args
from hybrid.estimate.memory import expert_exchange_bytes, peak_memory
from hybrid.estimate.workload import workload
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import seed_all
from hybrid.train.setup import build_engine

PP = 16
WORLDS = (64, 1024)


def flags(world: int, zero_stage: int, hidden: int = 128, seq: int = 16) -> list[str]:
    """The pretrain_gpt.py flags of the run: one MoE layer a stage, EP = DP, one expert
    an EP rank, top 2."""
    ep = world // PP
    return ["--num-layers", str(PP), "--hidden-size", str(hidden),
            "--num-attention-heads", "8", "--seq-length", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", str(PP * ep),
            "--pipeline-model-parallel-size", str(PP), "--pipeline-schedule", "1f1b",
            "--num-experts", str(ep), "--expert-model-parallel-size", str(ep),
            "--moe-router-topk", "2", "--moe-ffn-hidden-size", str(hidden),
            "--zero-stage", str(zero_stage), "--zero-param-persistence-threshold", "0",
            "--make-vocab-size-divisible-by", "1", "--tokenizer-type", "byte",
            "--hidden-dropout", "0", "--attention-dropout", "0"]


@contextlib.contextmanager
def _symmetric_all_to_all():
    """The fake group's all-to-all leaves its output as allocated: make it the input (every
    peer sending what this rank sends), so the counts' exchange gives splits that agree
    with the rows' and every step routes alike."""
    real = dist.all_to_all_single

    def exchange(output, input, output_split_sizes=None, input_split_sizes=None,
                 group=None, async_op=False):
        work = real(output, input, output_split_sizes, input_split_sizes, group=group,
                    async_op=async_op)
        output.copy_(input.reshape(output.shape))
        return work

    dist.all_to_all_single = exchange
    try:
        yield
    finally:
        dist.all_to_all_single = real


def last_rank(world: int, zero_stage: int = 1, steps: int = 1, hidden: int = 128) -> dict:
    """Build and step rank ``world - 1`` of PP 16 x EP ``world / 16`` through the fake
    process group (module doc); its figures and the estimator's."""
    cfg = build_config(parse_args(flags(world, zero_stage, hidden)), world)
    t0 = time.perf_counter()
    with fake_world(world) as rank:
        ps = ParallelState.build(1, pipeline_model_parallel_size=PP,
                                 expert_model_parallel_size=world // PP)
        try:
            groups_s = time.perf_counter() - t0
            rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
            model, _, engine = build_engine(cfg, ps, VOCAB, rng)
            setup_s = time.perf_counter() - t0
            # a received activation: normal values from one seeded generator, another each
            # micro-batch (zeros would give every token the same experts)
            gen = torch.Generator().manual_seed(0)
            with filled_receives(lambda t: t.copy_(torch.randn(t.shape, generator=gen))), \
                    _symmetric_all_to_all():
                stepped = timed_steps(cfg, ps, model, engine, steps, "all_to_all")
            w = dataclasses.replace(workload(cfg, VOCAB, "cpu"), stage=ps.pp_rank)
            assert cfg.model.moe is not None  # (the flags give experts)
            return {
                "world": world, "rank": rank, "pp": ps.pp_size, "pp_rank": ps.pp_rank,
                "dp": ps.dp_size, "ep": ps.ep_group.size, "ep_rank": ps.ep_group.rank,
                "edp": ps.edp_group.size, "experts": cfg.model.moe.num_experts,
                "zero_stage": zero_stage, "micro_batches": cfg.num_micro_batches,
                "setup_s": setup_s, "setup_groups_s": groups_s,
                "setup_model_s": setup_s - groups_s, **stepped,
                "local_experts": [tuple(layer.experts.fc.shape)
                                  for layer in model.moe_layers().values()],
                "model_state_bytes": engine.model_state_bytes()["total"],
                "model_state_bytes_estimated": peak_memory(w)["model_states"],
                "all_to_all_bytes_estimated": expert_exchange_bytes(w)}
        finally:
            ps.release()


def main(argv=None) -> int:
    a = scale_args(__doc__, argv)
    hidden = a.hidden or 128
    emit({"bench": "moe_scale", "machine": machine(),
        "layout": f"PP {PP} x EP world/{PP} (= DP), one expert an EP rank, rank world - 1",
        "flags": flags(1024, a.zero_stage, hidden), "rounds": a.rounds, "steps": a.steps,
        "order": "ABBA by round, after one untimed build and step of each world"})
    records = abba(WORLDS, a.rounds, a.steps,
                   lambda world, steps: last_rank(world, a.zero_stage, steps, hidden))
    for rec in records.values():
        emit(rec)
    small, big = records[WORLDS[0]], records[WORLDS[-1]]
    emit({"summary": {
        "setup_s": {str(w): r["setup_s"] for w, r in records.items()},
        "step_s": {str(w): r["step_s"] for w, r in records.items()},
        "setup_ratio": round(big["setup_s"] / small["setup_s"], 3),
        "step_ratio": round(big["step_s"] / small["step_s"], 3),
        "model_state_bytes_equal": all(
            r["model_state_bytes"] == r["model_state_bytes_estimated"]
            for r in records.values()),
        "all_to_all_over_estimate": {
            str(w): round(r["all_to_all_bytes_per_step"][-1]
                          / r["all_to_all_bytes_estimated"], 4)
            for w, r in records.items()}}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
