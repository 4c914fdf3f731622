"""Gradients that only land on the device (an offloaded optimizer at stages 2-3,
hybrid/zero/offload/landing.py): the same bits as a gradient shard kept whole, with the
device holding two unit shards of gradient whatever the model size.

On a CPU the whole shard is kept (it is the host buffer) unless the delayed update
is on; with a warmup as long as the run the delayed update never delays, so the
two runs do the same arithmetic and only the gradients' path differs."""

import torch

from hybrid.estimate.tiers import tier_bytes
from hybrid.estimate.workload import workload
from hybrid.tensor_parallel import InitValues
from hybrid.zero.offload.landing import GradLanding
from hybrid.zero.state import iter_piece_values
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import (
    VOCAB,
    _dp_step,
    _gpt,
    _named_params,
    _train_cfg,
    zero_engine,
)

STEPS = 2  # the second step's gradients are taken at parameters the first updated
LANDS = {"offload_delayed_update": True, "offload_delayed_update_warmup": STEPS}
# (fp16, TP 2 with SP and recompute, the delayed update: the nvme tier lands on a CPU too,
# and tests/zero/test_nvme_offload.py compares it with the host tier bit for bit)
VARIANTS = [(2, {}), (3, {"bf16": True, "overlap_comm": True, "offload_param": "cpu"})]


def _run(ps, stage, kw):
    cfg = _train_cfg(ps.world_size, ps.tp_size, zero_stage=stage, offload_optimizer="cpu",
                     **kw)
    model = _gpt(cfg, ps, device="meta")
    engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))
    parks = []  # per step: units whose partial sum went down before the last micro-batch
    if isinstance(engine.sink, GradLanding):
        park = engine.sink.partial  # (an earlier micro-batch's sum goes down: parked)

        def spy(unit):
            parks[-1].append(unit.name)
            park(unit)
        engine.reducer.sink.partial = spy
    losses, norms = [], []
    for step in range(STEPS):
        parks.append([])
        loss, result = _dp_step(model, engine, ps, cfg, step)
        losses.append(loss)
        norms.append(float(result.grad_norm))
    engine.wait_optimizer()
    grads = [engine.grad_values(pc).clone() for pc in engine.owned_pieces()]
    biggest = max(u.own_hi - u.own_lo for u in engine.units)
    return {"losses": losses, "norms": norms, "params": _named_params(model, engine),
            "pieces": [v.clone() for v in iter_piece_values(engine)], "grads": grads,
            "device_grads": engine.model_state_bytes()["grads"],
            "estimate": tier_bytes(workload(cfg, VOCAB, "cpu"),
                                   cfg.offload)["terms"]["device"]["grads"],
            "flat": engine.flat_grads is not None, "parks": parks,
            "units": sorted(u.name for u in engine.units), "biggest": biggest,
            "grad_bytes": torch.empty((), dtype=engine.grad_dtype).element_size()}


def _pairs(ps):
    return [(_run(ps, stage, kw), _run(ps, stage, {**kw, **LANDS})) for stage, kw in VARIANTS]


def test_landed_gradients_train_bit_for_bit_like_a_whole_shard():
    """TP1 x DP2, two micro-batches per step: stage 2 in fp32, stage 3 in bf16 with
    overlapped reductions and parameter offload. Every loss, norm, parameter, master,
    moment and gradient element equal; the landed run keeps no flat gradient shard,
    only two landing buffers of the largest unit's shard (the estimator's term), and
    each unit's first micro-batch's sum went down (parked) once per step."""
    for rank, per_rank in enumerate(run_ranks(_pairs, world_size=2, tp=1, timeout=180)):
        for (stage, kw), (whole, landed) in zip(VARIANTS, per_rank):
            what = f"rank {rank}, stage {stage} {kw}"
            assert whole["losses"] == landed["losses"], (what, whole["losses"],
                                                         landed["losses"])
            assert whole["norms"] == landed["norms"], what
            for name, t in whole["params"].items():
                assert torch.equal(t, landed["params"][name]), (what, name)
            for key in ("pieces", "grads"):
                assert len(whole[key]) == len(landed[key]) > 0, what
                assert all(torch.equal(a, b) for a, b in zip(whole[key], landed[key])), \
                    (what, key)
            assert whole["flat"] and not landed["flat"], what
            assert landed["device_grads"] == 2 * landed["biggest"] * landed["grad_bytes"]
            # the estimator's term: exact at stage 3 (blocks, the root); at stage 2 a
            # bound (its largest unit is the padded word embedding, 384 x 32 here)
            assert (landed["device_grads"] == landed["estimate"] if stage == 3
                    else landed["device_grads"] <= landed["estimate"]), (what, landed)
            assert landed["device_grads"] < whole["device_grads"], what
            for parks in landed["parks"]:
                assert sorted(parks) == landed["units"], (what, parks)
