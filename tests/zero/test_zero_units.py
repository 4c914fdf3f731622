"""ZeRO's unit layout: sharded construction from the meta device, shared parameters."""

import pytest
import torch

from hybrid.parallel.state import ParallelState
from hybrid.recompute.checkpointing import apply_activation_checkpointing
from hybrid.tensor_parallel import InitValues
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import (
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
            if name == "wte.weight":
                got, want = got[: want.shape[0]], want[: got.shape[0]]
            expect = want.bfloat16().float() if flags else want
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


@pytest.fixture(scope="module")
def tied_reference():
    """Plain torch on the tied TP1 model: AdamW, clip_grad_norm_, the whole batch."""
    cfg = _train_cfg(1, 1)
    return _train_reference(_tie(_gpt(cfg, ParallelState.single())), cfg)


def _train_tied(ps, variants):
    out = []
    for stage, recompute, kw in variants:
        cfg = _train_cfg(ps.world_size, ps.tp_size, zero_stage=stage, **kw)
        model = _tie(_gpt(cfg, ps, device="meta"))
        phase = None
        if recompute:
            phase = apply_activation_checkpointing(model, ps, None, cfg.recompute).phase
        engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of),
                            recompute=phase)
        losses, _ = _train_steps(model, engine, ps, cfg)
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
    and parameters after 3 steps equal the one-process tied model's."""
    # at TP2 the stages where sharing meets TP-split weights differently: 0 (nothing
    # sharded) and 3 (the shared weight in the root unit, gathered per step)
    variants = TIED if tp == 1 else [v for v in TIED if v[0] in (0, 3)]
    res = run_ranks(_train_tied, world_size=tp * dp, tp=tp, args=(variants,))
    ref = tied_reference
    for v, (stage, recompute, kw) in enumerate(variants):
        what = f"stage {stage} recompute={recompute} {kw} TP{tp}xDP{dp}"
        got = res[0][v]
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), f"{what}: loss {a} vs {b}"
        assert set(got["params"]) == set(ref["params"])  # the tied names are the same
        for name, want in ref["params"].items():
            full = _full_params([r[v]["params"] for r in res], tp, name, got["specs"][name])
            if name == "wte.weight":
                full, want = full[:want.shape[0]], want[:full.shape[0]]
            torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, what=what, name=name: f"{what}: {name}: {m}")
