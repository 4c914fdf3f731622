#!/usr/bin/env python
"""One process as the last rank of a 64- and a 1,024-rank pipeline run: set-up and step.

    python -m benchmarks.bench_pipeline_scale [--zero-stage 1] [--rounds 5] [--steps 3]

The process joins torch's fake process group (every collective and every send
returns at once; a receive leaves its buffer as it was) as rank ``world - 1`` of
PP 8 x TP 8 x DP ``world / 64``: world 64 is DP 1, world 1,024 DP 16. That rank is
the last pipeline stage's last TP rank. Set-up is what a run does before its first
step: the default group, this rank's TP, DP, PP and embedding group
(:meth:`hybrid.parallel.state.ParallelState.build`, which creates only the rank's own
group of each kind, its members alone taking part) and this stage's model under ZeRO
(:func:`hybrid.train.setup.build_engine`). A step is
:func:`hybrid.train.step.train_step` under 1F1B: the stage's
forwards from received activations, the loss, the backwards whose input gradients go
back to stage 6, ZeRO's reduction over DP and the AdamW step.

The model is small (one layer per stage, sequence 16, micro-batch 1; hidden 1024 by
default, 128 in the test) but the layout is the real one, so what grows with the world
(the groups' rank lists, DP's shards) is what the ratio shows: 4 ``new_group`` calls at
either world (448 at 1,024 against 32 at 64 before each rank made only its own). A
received tensor is filled with zeros (a peer sending zeros) so that every step computes
the same; the fake group sums nothing, so the loss is this TP rank's slice of the
vocabulary only and the gradient norm is this rank's.

One record per world size, then a summary: the median set-up and step seconds over
``--rounds`` (the world sizes take turns, ABBA), the model-state bytes this rank holds
(:meth:`ZeroEngine.model_state_bytes`) beside the estimator's
(:func:`hybrid.estimate.model_states.model_state_bytes` of this stage's parameters),
the p2p bytes a step sends beside the estimator's
(:func:`hybrid.estimate.pipeline.p2p_bytes_per_step`), and the 1,024-rank figures over
the 64-rank ones. Nothing is asserted about time; docs/pipeline-parallelism.md keeps
the figures with their machine and date. ``tests/pipeline/test_pipeline_scale.py``
holds the exact figures.
"""

from __future__ import annotations

import dataclasses
import sys
import time

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
from hybrid.estimate.model_states import model_state_bytes
from hybrid.estimate.pipeline import p2p_bytes_per_step
from hybrid.estimate.workload import workload
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import seed_all
from hybrid.train.setup import build_engine

TP, PP = 8, 8
WORLDS = (64, 1024)


def flags(world: int, zero_stage: int, layers: int = 8, hidden: int = 128, heads: int = 8,
          seq: int = 16, micro_batch: int = 1, m: int = PP) -> list[str]:
    """The pretrain_gpt.py flags of the run. Every ZeRO unit of the last stage divides
    over DP 16 at these sizes (no padding), and the vocabulary is padded to a multiple
    of TP only, so the last TP rank holds real rows (one made of padding alone would
    take a loss of -inf)."""
    dp = world // (TP * PP)
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--micro-batch-size", str(micro_batch), "--global-batch-size",
            str(micro_batch * m * dp), "--tensor-model-parallel-size", str(TP),
            "--pipeline-model-parallel-size", str(PP), "--pipeline-schedule", "1f1b",
            "--zero-stage", str(zero_stage), "--zero-param-persistence-threshold", "0",
            "--make-vocab-size-divisible-by", "1", "--tokenizer-type", "byte",
            "--hidden-dropout", "0", "--attention-dropout", "0"]


def last_rank(world: int, zero_stage: int = 1, steps: int = 1, **shape) -> dict:
    """Build and step rank ``world - 1`` of PP 8 x TP 8 x DP ``world / 64`` through the
    fake process group (module doc); its figures and the estimator's."""
    cfg = build_config(parse_args(flags(world, zero_stage, **shape)), world)
    t0 = time.perf_counter()
    with fake_world(world) as rank:
        ps = ParallelState.build(TP, pipeline_model_parallel_size=PP)
        try:
            groups_s = time.perf_counter() - t0
            rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
            model, _, engine = build_engine(cfg, ps, VOCAB, rng)
            setup_s = time.perf_counter() - t0
            with filled_receives(lambda t: t.zero_()):  # (a peer sending zeros)
                stepped = timed_steps(cfg, ps, model, engine, steps, "p2p")
            w = dataclasses.replace(workload(cfg, VOCAB, "cpu"), stage=ps.pp_rank)
            estimate = model_state_bytes(w.psi, w.shard_ranks, zero_stage, w.params_dtype,
                                         w.grads_dtype)
            measured = engine.model_state_bytes()
            return {
                "world": world, "rank": rank, "tp": ps.tp_size, "dp": ps.dp_size,
                "pp": ps.pp_size, "pp_rank": ps.pp_rank, "tp_rank": ps.tp_rank,
                "is_last_stage": ps.is_last_stage, "zero_stage": zero_stage,
                "micro_batches": cfg.num_micro_batches, "setup_s": setup_s,
                "setup_groups_s": groups_s, "setup_model_s": setup_s - groups_s, **stepped,
                "params": sum(p.numel() for p in model.parameters()),
                "params_padded": sum(u.padded for u in engine.units),
                "params_estimated": w.psi,
                "model_state_bytes": {k: measured[k] for k in ("params", "grads",
                                                               "optimizer", "total")},
                "model_state_bytes_estimated": estimate,
                "p2p_bytes_estimated": p2p_bytes_per_step(w)["ranks"][ps.pp_rank]}
        finally:
            ps.release()


def main(argv=None) -> int:
    a = scale_args(__doc__, argv)
    # (a multiple of 128 keeps ZeRO's units unpadded)
    shape = {"hidden": a.hidden or 1024}
    emit({"bench": "pipeline_scale", "machine": machine(),
        "layout": f"PP {PP} x TP {TP} x DP world/64, rank world - 1",
        "flags": flags(1024, a.zero_stage, **shape), "rounds": a.rounds, "steps": a.steps,
        "order": "ABBA by round, after one untimed build and step of each world"})
    records = abba(WORLDS, a.rounds, a.steps,
                   lambda world, steps: last_rank(world, a.zero_stage, steps, **shape))
    for rec in records.values():
        rec["model_state_bytes_equal"] = (rec["model_state_bytes"]["total"]
                                          == rec["model_state_bytes_estimated"]["total"])
        emit(rec)
    small, big = records[WORLDS[0]], records[WORLDS[-1]]
    emit({"summary": {
        "setup_s": {str(w): r["setup_s"] for w, r in records.items()},
        "step_s": {str(w): r["step_s"] for w, r in records.items()},
        "setup_ratio": round(big["setup_s"] / small["setup_s"], 3),
        "setup_groups_s": {str(w): r["setup_groups_s"] for w, r in records.items()},
        "setup_model_s": {str(w): r["setup_model_s"] for w, r in records.items()},
        "step_ratio": round(big["step_s"] / small["step_s"], 3),
        "model_state_bytes": {str(w): r["model_state_bytes"]["total"]
                              for w, r in records.items()},
        "model_state_bytes_equal": all(r["model_state_bytes_equal"]
                                       for r in records.values()),
        "p2p_bytes_equal": all(set(r["p2p_bytes_per_step"]) == {r["p2p_bytes_estimated"]}
                               for r in records.values())}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
