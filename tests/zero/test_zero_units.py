"""ZeRO's unit layout: sharded construction from the meta device, shared parameters."""

import pytest
import torch

from hybrid.parallel.state import ParallelState
from hybrid.recompute.checkpointing import apply_activation_checkpointing
from hybrid.tensor_parallel import InitValues
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import (
    BUCKETS,
    _gpt,
    _named_params,
    _train_cfg,
    _train_reference,
    _train_steps,
    zero_engine,
)


def _full_params(res, tp, name, spec):
    """Full tensor of ``name`` from the first DP replica's TP ranks."""
    parts = [res[r][name] for r in range(tp)]
    return parts[0] if spec is None else torch.cat(parts, dim=spec.dim)


# -- sharded construction ---------------------------------------------------------------
def _construct(ps, stage, dtype_flags):
    """Build on meta, let ZeRO materialize: the full params (gathered), the fp32 master
    pieces and the bytes this rank holds right after construction."""
    cfg = _train_cfg(ps.world_size, ps.tp_size, zero_stage=stage, **dtype_flags)
    model = _gpt(cfg, ps, device="meta")
    engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))
    master = {(pc.name, pc.lo): engine.optimizer.master[pc.unit][pc.part].clone()
              for pc in engine.owned_pieces()}
    held = engine.model_state_bytes()["params"]
    specs = {n: getattr(p, "tp_spec", None) for n, p in model.named_parameters()}
    return {"params": _named_params(model, engine), "master": master, "held": held,
            "specs": specs, "padded": sum(u.padded for u in engine.units)}


def _construct_each(ps, variants):
    """:func:`_construct` for each (stage, dtype flags), in one call on the ranks."""
    return [_construct(ps, stage, flags) for stage, flags in variants]


@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 2), (1, 4)])
def test_meta_construction_gives_the_same_full_model_in_every_layout(tp, dp):
    """Stages 0-3, fp32 and bf16: the model ZeRO materializes from the meta device,
    gathered, equals to the bit the one-process model built with the same seed (bf16:
    its rounding), the fp32 master pieces are the exact fp32 init, and at stage 3 a
    rank holds only its 1/N shard of the parameters after construction."""
    cfg = _train_cfg(1, 1)
    ref = {n: p.detach() for n, p in _gpt(cfg, ParallelState.single()).named_parameters()}
    variants = [(stage, flags) for stage in range(4) for flags in ({}, {"bf16": True})]
    per_rank = run_ranks(_construct_each, world_size=tp * dp, tp=tp, args=(variants,))
    for k, (stage, flags) in enumerate(variants):
        res = [r[k] for r in per_rank]
        specs = res[0]["specs"]
        for name, want in ref.items():
            got = _full_params([r["params"] for r in res], tp, name, specs[name])
            expect = want
            if name == "wte.weight":
                got, expect = got[: want.shape[0]], want[: got.shape[0]]
            if flags:
                expect = expect.bfloat16().float()
            assert torch.equal(got, expect), f"stage {stage} {flags} TP{tp}xDP{dp} {name}"
        for r in res:
            spec_of = r["specs"]
            for (name, lo), piece in r["master"].items():
                full, spec = ref[name], spec_of[name]
                if spec is not None and spec.full_shape != tuple(full.shape):  # vocab pad
                    full = torch.cat([full, full.new_zeros(
                        spec.full_shape[0] - full.shape[0], *full.shape[1:])])
                local = full if spec is None else full.chunk(spec.size, spec.dim)[spec.rank]
                local = local.reshape(-1)
                n = min(piece.numel(), local.numel() - lo)
                assert torch.equal(piece[:n], local[lo: lo + n]), (stage, name, lo)
            if stage == 3:  # its shard of every unit, nothing whole
                elem = 2 if flags else 4
                assert r["held"] == r["padded"] // dp * elem


# -- shared parameters -----------------------------------------------------------------
def _tie(model):
    """Two blocks share their MLP up-projection weight and their first LayerNorm."""
    b0, b1 = model.blocks[0], model.blocks[1]
    b1.mlp.fc.weight = b0.mlp.fc.weight
    b1.ln_1.weight = b0.ln_1.weight
    return model


# the tied curves: 2 steps, the second on the first's Adam moments and on the shared
# parameters the first step updated once (not once per use)
STEPS = 2


@pytest.fixture(scope="module")
def tied_reference():
    """Plain torch on the tied TP1 model: AdamW, clip_grad_norm_, the whole batch."""
    cfg = _train_cfg(1, 1)
    return _train_reference(_tie(_gpt(cfg, ParallelState.single())), cfg, STEPS)


def _train_tied(ps, variants):
    out = []
    for stage, recompute, kw in variants:
        cfg = _train_cfg(ps.world_size, ps.tp_size, zero_stage=stage, **BUCKETS, **kw)
        model = _tie(_gpt(cfg, ps, device="meta"))
        phase = None
        if recompute:
            phase = apply_activation_checkpointing(model, ps, None, cfg.recompute).phase
        engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of),
                            recompute=phase)
        losses, _ = _train_steps(model, engine, ps, cfg, STEPS)
        out.append({"losses": losses, "params": _named_params(model, engine),
                    "specs": {n: getattr(p, "tp_spec", None)
                              for n, p in model.named_parameters()}})
    return out


TIED = [(stage, recompute, kw) for stage in range(4) for recompute in (False, True)
        for kw in ({}, {"overlap_comm": True, "zero_param_persistence_threshold": 100})
        if not (kw and stage in (0, 1))]


@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 2)])
def test_shared_parameters_train_like_one_process(tied_reference, tp, dp):
    """A weight and a LayerNorm shared by two blocks, at every stage, with and without
    recompute (each checkpointed block then runs its own nested backward), stage 3
    with the shared LayerNorm persistent or partitioned (TP2: stages 0 and 3): losses
    and parameters after STEPS steps equal the one-process tied model's. Buckets of
    4000 (zero_reference.BUCKETS)."""
    # at TP2 the stages where sharing meets TP-split weights differently: 0 (nothing
    # sharded) and 3 (the shared weight in the root unit, gathered per step)
    variants = TIED if tp == 1 else [v for v in TIED if v[0] in (0, 3)]
    res = run_ranks(_train_tied, world_size=tp * dp, tp=tp, args=(variants,))
    ref = tied_reference
    for v, (stage, recompute, kw) in enumerate(variants):
        what = f"stage {stage} recompute={recompute} {kw} TP{tp}xDP{dp}"
        got = res[0][v]
        assert len(got["losses"]) == len(ref["losses"]) == STEPS, what
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), f"{what}: loss {a} vs {b}"
        assert set(got["params"]) == set(ref["params"])  # the tied names are the same
        for name, want in ref["params"].items():
            full = _full_params([r[v]["params"] for r in res], tp, name, got["specs"][name])
            expect = want
            if name == "wte.weight":
                full, expect = full[:want.shape[0]], want[:full.shape[0]]
            torch.testing.assert_close(full, expect, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, what=what, name=name: f"{what}: {name}: {m}")


# -- a tied embedding's copies on two pipeline stages -------------------------------------
def _stage_engine(ps, stage, tied=("wte.weight",), threshold=2000):
    """This rank's pipeline stage of a 2-layer tied GPT (one layer each at PP 2), under
    ZeRO ``stage`` with ``tied``; stage 3 partitions what has ``threshold`` elements or
    more."""
    from hybrid.config.model import ModelConfig
    from hybrid.config.sections import ZeroConfig
    from hybrid.zero import apply_zero
    from models.gpt import GPT
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                      max_position_embeddings=8).with_vocab_size(64)
    r, p = ps.pp_rank, ps.pp_size
    layers = range(r * 2 // p, (r + 1) * 2 // p)
    model = GPT(cfg, ps.tp_group, seed=3, device="meta", layers=layers,
                pre_process=ps.is_first_stage, post_process=ps.is_last_stage)
    return apply_zero(model, ps, ZeroConfig(stage=stage, param_persistence_threshold=threshold),
                      values=InitValues(3, model.init_of), tied=tied)


def _tied_layouts(ps):
    out = []
    for stage in range(4):
        e = _stage_engine(ps, stage)
        out.append({"tied": [(u.name, u.padded, u.own_lo, u.own_hi, u.partition_params)
                             for u in e.tied_units],
                    "first": e.units[0] is (e.tied_units or [None])[0],
                    "excluded": sorted(e.optimizer.excluded)})
    return out


def test_a_tied_embedding_gets_the_same_unit_on_both_stages_and_counts_once():
    """PP 2 x DP 2, stages 0-3: on the first and the last stage ``wte.weight`` is a unit of
    its own, first in the rank's shard, of the same size and DP range on both (so its
    gradient shards sum element for element), partitioned at stage 3; only the last
    stage leaves it out of the norm."""
    res = run_ranks(_tied_layouts, world_size=4, pp=2)
    for stage in range(4):
        rows = [r[stage] for r in res]  # ranks 0, 1: the first stage; 2, 3: the last
        for rank, row in enumerate(rows):
            d = rank % 2
            # (the vocabulary padded to 128 rows of 32)
            assert row["tied"] == [("wte.weight", 4096, 0 if stage == 0 else d * 2048,
                                    4096 if stage == 0 else (d + 1) * 2048, stage == 3)], \
                (stage, rank, row)
            assert row["first"], (stage, rank)
            assert row["excluded"] == ([] if rank < 2 else [0]), (stage, rank, row)


def _last_stage_gathers(ps):
    """All-gathered bytes of one forward and backward of the last stage at ZeRO 3 (its
    root unit, the final norm, partitioned too), and what its partitioned units hold."""
    e = _stage_engine(ps, 3, threshold=20)
    if not ps.is_last_stage:
        return None
    before = ps.dp_group.stats.bytes["all_gather"]
    g = torch.Generator().manual_seed(ps.rank)
    e.backward(e.model(hidden=torch.randn(2, 8, 32, generator=g),
                       labels=torch.randint(0, 64, (2, 8), generator=g)))
    return (ps.dp_group.stats.bytes["all_gather"] - before,
            [(u.name, u.padded) for u in e.units if u.partition_params])


def test_stage3_gathers_a_tied_copy_once_each_way():
    """At ZeRO 3 the last stage's copy of wte is the root module's second unit: gathered
    for the forward and again at the loss, and not prefetched a third time by the first
    block's backward after its gradient freed it (counted: a gather over DP 2 moves half
    the unit's bytes, so a forward and a backward move all of them)."""
    res = run_ranks(_last_stage_gathers, world_size=4, pp=2)
    for moved, units in res[2:]:
        assert [n for n, _ in units] == ["wte.weight", "root", "module0"], units
        assert moved == 4 * sum(n for _, n in units), (moved, units)


def test_tied_names_change_nothing_where_the_embedding_group_is_one_rank():
    """At PP 1 the embedding group is this rank alone: nothing to sum, and the units (names,
    sizes, order) are those of an engine built without ``tied``, at every stage."""
    ps = ParallelState.single()
    for stage in range(4):
        a, b = (_stage_engine(ps, stage, tied) for tied in (("wte.weight",), ()))
        assert a.tied_units == [] and a.optimizer.excluded == frozenset()
        assert ([(u.name, u.padded) for u in a.units]
                == [(u.name, u.padded) for u in b.units]), stage
