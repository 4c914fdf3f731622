"""ZeRO-Offload's overlap: gradients go down per unit during backward, and the
one-step delayed parameter update against a reference that applies each update
one step late."""

import threading

import pytest
import torch

from hybrid.config import Flags, build_config
from hybrid.config.model import ModelConfig
from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import InitValues, seed_all
from models.gpt import GPT
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import BUCKETS, zero_engine

VOCAB, SEQ, MICRO, BATCH, STEPS, SEED = 257, 16, 2, 8, 5, 5


def _cfg(world, **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                hidden_dropout=0.0, attention_dropout=0.0, micro_batch_size=MICRO,
                global_batch_size=BATCH, lr=1e-2, weight_decay=0.1, clip_grad=0.5,
                reduce_bucket_size=1000, allgather_bucket_size=1000, adam_eps=1e-4,
                zero_param_persistence_threshold=0, seed=SEED)
    base.update(kw)
    return build_config(Flags(**base), world)


def _gpt(cfg, ps, device):
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    m = ModelConfig(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_attention_heads=4,
                    max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    return GPT(m, ps.tp_group, rng=rng, seed=cfg.seed, device=device)


def _global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def _params(model, engine):
    with engine.gathered():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _train(ps, variants):
    out = []
    for stage, kw in variants:
        # buckets of 4000 (zero_reference.BUCKETS): still several units per step at
        # stages 1-2 (the embedding, 12288 elements, one of its own), stage 3's whole blocks
        cfg = _cfg(ps.world_size, zero_stage=stage, offload_optimizer="cpu", **BUCKETS, **kw)
        model = _gpt(cfg, ps, "meta")
        engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))
        sent = []  # per step: (unit index, gradients arrived so far) for each unit sent down
        final = engine.reducer.sink.final  # (the offload's sink: copy down, or landing)

        def spy(unit, final=final, engine=engine, sent=sent):
            sent[-1].append((engine.offload.index[id(unit)],
                             sum(engine.reducer._arrived.values()), engine.reducer.sync))
            final(unit)
        engine.reducer.sink.final = spy
        losses, norms = [], []
        per = BATCH // ps.dp_size
        for step in range(STEPS):
            engine.zero_grad()
            mine = _global_batch(step)[ps.dp_rank * per: (ps.dp_rank + 1) * per]
            batches = [(b[:, :-1], b[:, 1:]) for b in mine.split(MICRO)]
            total = torch.zeros(())
            sent.append([])
            for i, (x, y) in enumerate(batches):
                loss = model(x, y) / len(batches)
                engine.backward(loss, sync=i == len(batches) - 1)
                total += loss.detach()
            ps.dp_group.all_reduce(total)
            losses.append(float(total) / ps.dp_size)
            norms.append(float(engine.step(cfg.lr_schedule.lr).grad_norm))
        device_params = _params(model, engine)  # what the model runs with
        engine.wait_optimizer()
        master = {(pc.name, pc.lo): engine.optimizer.master[pc.unit][pc.part]
                  for pc in engine.owned_pieces()}
        out.append({"losses": losses, "norms": norms, "params": device_params,
                    "master": master, "sent": sent, "steps": engine.optimizer.step_count,
                    "units": len(engine.units),
                    "n_params": sum(len(u.params) for u in engine.units)})
    return out


def _reference(cfg, warmup):
    """torch: AdamW on fp32 master copies, clip_grad_norm_, the whole global batch;
    the model runs with master m(t-1) after a normal step t <= warmup, and with
    m(t-1) also after a delayed one -- the master *before* that step's update."""
    ps = ParallelState.single()
    model = _gpt(cfg, ps, "cpu")
    master = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    z = cfg.adamw
    opt = torch.optim.AdamW([{"params": [m for m in master if m.ndim >= 2],
                              "weight_decay": z.weight_decay},
                             {"params": [m for m in master if m.ndim < 2],
                              "weight_decay": 0.0}], lr=cfg.lr_schedule.lr, eps=z.eps)
    losses, norms = [], []
    for step in range(STEPS):
        model.zero_grad()
        total = 0.0
        for b in _global_batch(step).split(MICRO):
            loss = model(b[:, :-1], b[:, 1:]) / (BATCH // MICRO)
            loss.backward()
            total += loss.item()
        losses.append(total)
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(master, z.clip_grad)))
        before = [m.detach().clone() for m in master]
        opt.step()
        delayed = warmup is not None and step + 1 > warmup
        with torch.no_grad():
            for p, m, b in zip(model.parameters(), master, before):
                p.copy_(b if delayed else m)
    names = [n for n, _ in model.named_parameters()]
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "master": dict(zip(names, (m.detach() for m in master)))}


VARIANTS = [(2, {"offload_delayed_update": True, "offload_delayed_update_warmup": 1}),
            (1, {"offload_delayed_update": True}),
            (3, {"offload_delayed_update": True, "offload_delayed_update_warmup": 2}),
            (2, {})]


@pytest.fixture(scope="module")
def offloaded_runs():
    """VARIANTS trained once on TP1 x DP2, for the tests of this module that read them."""
    return run_ranks(_train, world_size=2, tp=1, args=(VARIANTS,))


def test_delayed_update_is_the_reference_applied_one_step_late(offloaded_runs):
    """TP1 x DP2, 5 steps: losses, clipped norms, the parameters the model ends with
    (one update behind) and the host master (current) equal the reference's, at
    stages 1-3 and warmups 0-2; the undelayed offload equals the plain reference.
    Both DP ranks end bit-identical (the worker's order does not depend on timing)."""
    res = offloaded_runs
    refs = {None: _reference(_cfg(1), None)}
    for (stage, kw), got in zip(VARIANTS, res[0]):
        warmup = (kw.get("offload_delayed_update_warmup", 0)
                  if kw.get("offload_delayed_update") else None)
        if warmup not in refs:
            refs[warmup] = _reference(_cfg(1), warmup)
        ref, what = refs[warmup], f"stage {stage} {kw}"
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (what, got["losses"], ref["losses"])
        for a, b in zip(got["norms"], ref["norms"]):
            assert abs(a - b) <= 1e-5 * abs(b), (what, got["norms"], ref["norms"])
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, what=what, name=name: f"{what}: {name}: {m}")
        for r in res:  # each rank's master pieces: the reference master's current values
            for (name, lo), piece in r[VARIANTS.index((stage, kw))]["master"].items():
                want = refs[warmup]["master"][name].reshape(-1)[lo: lo + piece.numel()]
                torch.testing.assert_close(piece, want, rtol=1e-5, atol=1e-6)
        assert got["steps"] == STEPS
        other = res[1][VARIANTS.index((stage, kw))]
        assert all(torch.equal(t, other["params"][n]) for n, t in got["params"].items())
    # the delay is real: from step warmup + 2 on, the delayed curve leaves the plain one
    assert refs[1]["losses"][3] != refs[None]["losses"][3]


def test_gradients_go_down_per_unit_during_the_last_backward(offloaded_runs):
    """Each unit's gradient shard is sent to the host exactly once per step, as soon
    as its reduction of the last micro-batch completes -- the first one while
    most of backward is still to come -- and never for earlier micro-batches (stages
    1-3, with and without the delayed update)."""
    for (stage, _), r in zip(VARIANTS, offloaded_runs[0]):
        n_params = r["n_params"]
        for sent in r["sent"]:
            assert sorted(i for i, _, _ in sent) == list(range(r["units"]))
            assert all(last for _, _, last in sent)  # only in the last micro-batch
            # hooks of this backward so far: the first unit went while most were to come
            # (stages 1-2; stage 3's units are whole blocks, the first sent after one)
            assert sent[0][1] < n_params // (2 if stage < 3 else 1), (stage, sent)


def _fp16_overflow(ps):
    out = []
    for kw in ({}, {"offload_delayed_update": True}):
        cfg = _cfg(ps.world_size, zero_stage=2, offload_optimizer="cpu", fp16=True,
                   hysteresis=1, initial_loss_scale=1024.0, **kw)
        model = _gpt(cfg, ps, "meta")
        engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))
        per = BATCH // ps.dp_size
        skipped = []
        for step in range(4):
            engine.zero_grad()
            mine = _global_batch(step)[ps.dp_rank * per: (ps.dp_rank + 1) * per]
            batches = [(b[:, :-1], b[:, 1:]) for b in mine.split(MICRO)]
            for i, (x, y) in enumerate(batches):
                # an overflow in one rank's backward only (its gradients leave the
                # device as they are reduced: nothing to poke after backward)
                blow = float("inf") if step == 1 and ps.dp_rank == 1 and i == 0 else 1.0
                engine.backward(model(x, y) * blow / len(batches),
                                sync=i == len(batches) - 1)
            skipped.append(bool(engine.step(cfg.lr_schedule.lr).skipped))
        engine.wait_optimizer()
        out.append({"skipped": skipped, "steps": engine.optimizer.step_count,
                    "params": _params(model, engine)})
    return out


def _watched_delayed_update(ps):
    """Stage 3 with the delayed update from the first step. The update of step 0 is held
    before its chunk of unit 0 (the embeddings, which backward sends last) until step
    1's backward has parked every other unit: it can, only if the update freed them
    first. That chunk then ends only once backward's park of unit 0 has returned (or
    0.5 s later): a park that did not wait for it records it missing. Returns (the
    chunks in the order the update ran them, per park of step 1 the unit and the
    chunks updated by then, each unit's chunks, whether the hold gave up)."""
    cfg = _cfg(ps.world_size, zero_stage=3, offload_optimizer="cpu",
               offload_delayed_update=True)
    model = _gpt(cfg, ps, "meta")
    engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))
    off = engine.offload
    touches = [t for t, _ in off._chunk_units]
    units = {i: [k for k, t in enumerate(touches) if i in t] for i in range(len(off.units))}
    done, parks, step, gate, gave_up = [], [], [0], threading.Event(), []
    parked0 = threading.Event()
    before, after, park = off._before_chunk, off._after_chunk, off.park

    def held_before(k):
        if 0 in touches[k] and not gate.wait(timeout=30):
            gave_up.append(k)  # (a deadlock otherwise: backward waits for this update)
        return before(k)

    def recorded_after(k):
        if 0 in touches[k]:
            parked0.wait(timeout=0.5)  # (times out unless the park came too early)
        done.append(k)
        after(k)

    def watched_park(unit):
        event = park(unit)
        if step[0] == 1:
            parks.append((off.index[id(unit)], list(done)))
            if off.index[id(unit)] == 0:
                parked0.set()
            if {i for i, _ in parks} >= set(units) - {i for k in units[0] for i in touches[k]}:
                gate.set()
        return event
    off._before_chunk, off._after_chunk, off.park = held_before, recorded_after, watched_park
    per = BATCH // ps.dp_size
    for step[0] in range(2):
        engine.zero_grad()
        mine = _global_batch(step[0])[ps.dp_rank * per: (ps.dp_rank + 1) * per]
        for i, b in enumerate(mine.split(MICRO)):
            engine.backward(model(b[:, :-1], b[:, 1:]), sync=i == per // MICRO - 1)
        if step[0] == 0:
            engine.step(cfg.lr_schedule.lr)  # its update runs on the worker during step 1
    engine.wait_optimizer()
    return done, parks, units, gave_up


def test_the_delayed_update_runs_last_to_first_and_frees_each_gradient_once_read():
    """The delayed update of step t runs its chunks last to first, the order in which
    step t + 1's backward sends gradients down, so backward never waits for the whole
    update (held before its first unit, the update still lets every other unit's
    gradient down); and no unit's host gradient is rewritten before every chunk of it
    was updated (checked at each park)."""
    for done, parks, units, gave_up in run_ranks(_watched_delayed_update, world_size=2, tp=1):
        assert not gave_up
        assert done == sorted(done, reverse=True) and len(done) == len(units) > 2
        assert {i for i, _ in parks} == set(units)
        for i, updated in parks:
            assert set(units[i]) <= set(updated), (i, units[i], updated)


def test_fp16_overflow_skips_an_offloaded_step_and_training_goes_on():
    """Dynamic fp16 with the gradients already sent down during backward: the skipped
    step frees their host buffers (else the next backward would wait for an update
    that never comes), and the next steps update normally on every rank."""
    res = run_ranks(_fp16_overflow, world_size=2, tp=1, timeout=120)
    for a, b in zip(*res):
        assert a["skipped"] == [False, True, False, False] and a["steps"] == 3
        assert all(torch.isfinite(t).all() for t in a["params"].values())
        assert all(torch.equal(t, b["params"][n]) for n, t in a["params"].items())


@pytest.mark.parametrize("flags,msg", [
    (dict(offload_delayed_update=True), "--offload-delayed-update delays"),
    (dict(offload_optimizer="cpu", zero_stage=2, offload_delayed_update=True,
          offload_delayed_update_warmup=-1), "--offload-delayed-update-warmup must be >= 0"),
    (dict(offload_optimizer="cpu", zero_stage=2, offload_delayed_update_warmup=3),
     "--offload-delayed-update-warmup needs --offload-delayed-update"),
])
def test_delayed_update_flags_are_checked(flags, msg):
    with pytest.raises(ConfigError, match=msg):
        build_config(Flags(**flags), 1)


def test_delayed_update_flags_reach_the_offload_config():
    o = build_config(Flags(zero_stage=2, offload_optimizer="cpu", offload_delayed_update=True,
              offload_delayed_update_warmup=4), 1).offload
    assert o.optimizer and o.delayed_update and o.delayed_update_warmup == 4
