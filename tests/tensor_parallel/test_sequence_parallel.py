"""Sequence parallelism: the same function as TP1, replicas that stay equal, ops that
send what their docstrings say.

With dropout 0, a GPT at TP 2 and 4 with ``sequence_parallel`` gives the loss,
logits and gradients of the one-process model from the same seed. With dropout
on, the parameters replicated over TP (LayerNorms, row-parallel biases,
positions) stay bit-identical across TP ranks through many optimizer steps.
"""

import pytest
import torch

from hybrid.config.model import ModelConfig
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import (
    gather_from_sequence,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    seed_all,
)
from models.gpt import GPT
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import (
    BUCKETS,
    _dp_step,
    _gpt,
    _named_params,
    _train_cfg,
    _train_stages,
    zero_engine,
)

SEED, V, T = 11, 257, 16


def _gpt_sp(ps, rng, sp, dropout=0.0):
    """The GPT of these tests at ``ps``'s TP size, with or without sequence parallelism
    (vocab 257 padded per TP size: 384 / 512 / 512)."""
    cfg = ModelConfig(vocab_size=V, num_layers=2, hidden_size=32, num_attention_heads=4,
                      max_position_embeddings=T, hidden_dropout=dropout,
                      attention_dropout=dropout)
    return GPT(cfg, ps.tp_group, rng=rng, seed=SEED, sequence_parallel=sp)


def _batch(step=0):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, V, (2, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _run(ps, sp):
    rng = seed_all(SEED, ps.tp_rank, ps.dp_rank, ps.device)
    model = _gpt_sp(ps, rng, sp)
    x, y = _batch()
    logits = model(x)
    loss = model(x, y)
    loss.backward()
    return {"loss": loss.detach(), "logits": logits.detach(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "specs": {n: getattr(p, "tp_spec", None) for n, p in model.named_parameters()}}


def _full(res, name):
    spec = res[0]["specs"][name]
    if spec is None:
        return res[0]["grads"][name]
    return torch.cat([r["grads"][name] for r in res], dim=spec.dim)


@pytest.fixture(scope="module")
def reference():
    return _run(ParallelState.single(), sp=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_matches_one_process(reference, tp):
    res = run_ranks(_run, world_size=tp, tp=tp, args=(True,))
    for r in res:
        torch.testing.assert_close(r["loss"], reference["loss"], rtol=1e-5, atol=1e-6)
    logits = torch.cat([r["logits"] for r in res], dim=-1)[..., :V]
    torch.testing.assert_close(logits, reference["logits"][..., :V], rtol=1e-5, atol=1e-5)
    for name, ref in reference["grads"].items():
        got = _full(res, name)[: ref.shape[0]] if name == "wte.weight" else _full(res, name)
        rel = (got - ref).norm() / ref.norm().clamp_min(1e-30)
        assert rel <= 1e-5, f"{name}: relative error {rel:.2e} at TP {tp}"
        if res[0]["specs"][name] is None:  # replicated: every TP rank holds the same grad
            for r in res[1:]:
                assert torch.equal(r["grads"][name], res[0]["grads"][name]), name


def _train_replicas(ps, steps):
    """Steps of AdamW with dropout on, SP at this TP size: replicated params per rank."""
    rng = seed_all(SEED, ps.tp_rank, ps.dp_rank, ps.device)
    model = _gpt_sp(ps, rng, True, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        x, y = _batch()  # one batch, learned by heart: the loss must fall
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    replicated = {n: p.detach().clone() for n, p in model.named_parameters()
                  if getattr(p, "tp_spec", None) is None}
    return {"losses": losses, "replicated": replicated}


def test_replicated_params_stay_bit_identical_with_dropout():
    res = run_ranks(_train_replicas, world_size=2, tp=2, args=(12,))
    names = set(res[0]["replicated"])
    assert {"wpe.weight", "ln_f.weight", "blocks.0.ln_1.bias", "blocks.1.mlp.proj.bias"} <= names
    for name in names:
        assert torch.equal(res[0]["replicated"][name], res[1]["replicated"][name]), name
    assert res[0]["losses"] == res[1]["losses"]
    assert res[0]["losses"][-1] < res[0]["losses"][0]  # it trained


def _ops(ps):
    """Each SP op's forward and backward against its definition, with byte counts."""
    g = ps.tp_group
    t = g.size
    full = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)  # same on every rank
    out = {}
    x = full.clone().requires_grad_()
    y = scatter_to_sequence(x, g)
    y.backward(torch.ones_like(y) * (g.rank + 1))
    out["scatter"] = (y.detach(), x.grad.clone())
    x = full.chunk(t, dim=1)[g.rank].clone().requires_grad_()
    before = g.stats.snapshot()
    y = gather_from_sequence(x, g)
    y.backward(torch.ones_like(y) * (g.rank + 1))
    out["gather"] = (y.detach(), x.grad.clone(), before, g.stats.snapshot())
    x = (full * (g.rank + 1)).requires_grad_()
    y = reduce_scatter_to_sequence(x, g)
    y.backward(torch.full_like(y, float(g.rank + 1)))
    out["reduce_scatter"] = (y.detach(), x.grad.clone())
    return out


def test_sequence_ops_forward_and_backward_collectives():
    t = 2
    res = run_ranks(_ops, world_size=t, tp=t)
    full = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    chunks = full.chunk(t, dim=1)
    for r, out in enumerate(res):
        y, gx = out["scatter"]
        assert torch.equal(y, chunks[r])
        # backward all-gathers every rank's chunk gradient (rank q's is q + 1)
        assert torch.equal(gx, torch.cat([torch.full_like(c, q + 1.0)
                                          for q, c in enumerate(chunks)], dim=1))
        y, gx, before, after = out["gather"]
        assert torch.equal(y, full)
        # backward reduce-scatters: the sum over ranks of (rank + 1), own chunk
        assert torch.equal(gx, torch.full_like(chunks[r], sum(range(1, t + 1))))
        sent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        chunk_bytes = chunks[r].numel() * 4
        assert sent["all_gather"] == chunk_bytes * t * (t - 1) / t
        assert sent["reduce_scatter"] == full.numel() * 4 * (t - 1) / t
        y, gx = out["reduce_scatter"]
        assert torch.equal(y, (full * sum(range(1, t + 1))).chunk(t, dim=1)[r])
        assert torch.equal(gx, torch.cat([torch.full_like(c, q + 1.0)
                                          for q, c in enumerate(chunks)], dim=1))


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


SP, RC = {"sequence_parallel": True}, {"recompute_granularity": "full"}
# TP 2 variants (stage, overrides), each compared with the first. (SP at TP 4 under ZeRO
# and recompute: tests/models/test_llama.py, whose Llama options make it the harder case.)
COMPOSE: list[tuple[int, dict]] = [
    (0, {}), (3, SP), (3, {**SP, **RC}), (0, {**SP, **RC, "partition_activations": True}),
    (2, {**SP, "overlap_comm": True, "offload_optimizer": True}),
    # both layers in one recompute group
    (3, {**SP, **RC, "recompute_method": "uniform", "recompute_num_layers": 2})]


def test_sequence_parallel_composes_with_zero_and_recompute(tp=2):
    """SP on vs off (ZeRO-0, no recompute), same seed and data, TP x DP = 4 ranks: the
    same loss curve and final parameters (relative 1e-5) with SP at ZeRO 3, with full
    recompute (also in groups of 2 layers), with --partition-activations (which SP
    makes moot: the block input is already this rank's 1/TP), and at ZeRO 2 with overlap
    and optimizer offload; two micro-batches per step throughout, two steps (the second
    on the first's Adam moments). Buckets of 4000 (zero_reference.BUCKETS)."""
    variants = [(stage, {**BUCKETS, **kw}) for stage, kw in COMPOSE]
    res = run_ranks(_train_stages, world_size=4, tp=tp, args=(variants, 2))[0]
    ref = res[0]
    for variant, r in zip(variants[1:], res[1:]):
        for la, lb in zip(ref["losses"], r["losses"]):
            assert abs(la - lb) <= 1e-5 * abs(la), (variant, ref["losses"], r["losses"])
        for name, p in ref["params"].items():
            assert _rel(r["params"][name], p) <= 1e-5, (variant, name)


def test_sequence_parallel_in_bf16_follows_the_bf16_curve():
    """bf16 with fp32 gradients, TP2 x DP2: SP at ZeRO-3 against no SP at ZeRO-0. SP sums
    over TP in another order (reduce-scatter, not all-reduce), so the curves agree to
    bf16's rounding (1e-2 relative), not bit for bit; the final replicated parameters
    stay equal across TP ranks. Two steps (the second on the first's Adam moments)."""
    variants = [(0, {"bf16": True, **BUCKETS}), (3, {"bf16": True, **SP, **BUCKETS})]
    res = run_ranks(_train_stages, world_size=4, tp=2, args=(variants, 2))
    ref, sp = res[0]
    for la, lb in zip(ref["losses"], sp["losses"]):
        assert abs(la - lb) <= 1e-2 * abs(la), (ref["losses"], sp["losses"])
    for name, p in ref["params"].items():
        assert _rel(sp["params"][name], p) <= 2e-2, name
        if sp["specs"][name] is None:
            assert torch.equal(res[1][1]["params"][name], sp["params"][name]), name


# fp16: a scale above this model's overflow threshold that halves on each overflow and
# doubles after 2 clean steps, so steps overflow and are skipped early and again later:
# at ZeRO-3, TP2 x DP2, the first step is skipped, four are taken (the scale doubling
# twice) and the sixth is skipped again
FP16 = {"fp16": True, "initial_loss_scale": 2.0 ** 19, "loss_scale_window": 2,
        "hysteresis": 1}
FP16_STEPS = 6


def _fp16_curves(ps, variants):
    """FP16_STEPS steps per variant (stage, overrides): mean losses over DP, which
    steps were skipped, the loss scale after each, final parameters (gathered)."""
    from hybrid.tensor_parallel import InitValues
    out = []
    for stage, kw in variants:
        cfg = _train_cfg(ps.world_size, ps.tp_size, zero_stage=stage, **FP16, **kw)
        model = _gpt(cfg, ps, device="meta")
        engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))
        losses, skipped, scales = [], [], []
        for step in range(FP16_STEPS):
            loss, result = _dp_step(model, engine, ps, cfg, step)
            losses.append(loss)
            skipped.append(bool(result.skipped))
            scales.append(result.loss_scale)
        out.append({"losses": losses, "skipped": skipped, "scales": scales,
                    "params": _named_params(model, engine),
                    "specs": {n: getattr(p, "tp_spec", None)
                              for n, p in model.named_parameters()}})
    return out


def test_sequence_parallel_in_fp16_skips_the_steps_tp_alone_skips():
    """fp16 with dynamic loss scaling, TP2 x DP2, two micro-batches per step: with SP
    the same steps overflow and are skipped as without it, the scale moves the same
    way, and the loss curve agrees to the bf16 test's 1e-2 relative. (Across stages the
    skips may differ near the threshold: stages 0-1 add a rank's micro-batch gradients
    in fp16 before the DP mean, stages 2-3 after it, so stage 0 overflows first. That
    is the stages, not SP.) The final replicated
    parameters stay bit-identical across TP ranks. At ZeRO-3 only: SP's fp16 path is
    the same at every stage, and stage 3 is the one that also shards parameters."""
    variants = [(3, BUCKETS), (3, {**SP, **BUCKETS})]
    res = run_ranks(_fp16_curves, world_size=4, tp=2, args=(variants,))
    for tp_only, sp in ((0, 1),):
        ref, got = res[0][tp_only], res[0][sp]
        assert got["skipped"] == ref["skipped"], (variants[sp], ref["skipped"], got["skipped"])
        assert got["scales"] == ref["scales"]
        # the scale came down and grew back: steps were skipped and steps were taken
        assert ref["skipped"][0] and 2 <= sum(ref["skipped"]) <= FP16_STEPS - 4, ref["skipped"]
        for la, lb in zip(ref["losses"], got["losses"]):
            assert abs(la - lb) <= 1e-2 * abs(la), (ref["losses"], got["losses"])
        for name, p in ref["params"].items():
            assert _rel(got["params"][name], p) <= 2e-2, name
            if got["specs"][name] is None:
                assert torch.equal(res[1][sp]["params"][name], got["params"][name]), name


def _sp_checkpoint_round_trip(ps, tmp):
    """Train 2 steps with SP on, save; load with SP off and save; load with SP on again.
    Every engine's parameters (gathered) and the losses of one more step each."""
    from hybrid.checkpoint import load_checkpoint, save_checkpoint
    from hybrid.config import Flags, build_config
    from hybrid.train.setup import build_engine

    def engine(sp, seed):
        cfg = build_config(Flags(tensor_model_parallel_size=2, num_layers=2, hidden_size=32,
                          num_attention_heads=4, seq_length=T, zero_stage=3, seed=seed,
                          sequence_parallel=sp, hidden_dropout=0.0,
                          attention_dropout=0.0), ps.world_size)
        rng = seed_all(seed, ps.tp_rank, ps.dp_rank, ps.device)
        model, _, eng = build_engine(cfg, ps, V, rng)
        return cfg, rng, model, eng

    def step(model, eng):
        x, y = _batch(7)
        eng.zero_grad()
        loss = model(x, y)
        eng.backward(loss)
        eng.step(1e-2)
        return float(loss.detach())

    def params(model, eng):
        with eng.gathered():
            return {n: p.detach().clone() for n, p in model.named_parameters()}

    out = []
    cfg, rng, model, eng = engine(True, 5)
    step(model, eng), step(model, eng)
    save_checkpoint(f"{tmp}/sp", 2, 4, eng, ps, cfg.to_dict(), rng, vocab_size=V)
    out.append((params(model, eng), step(model, eng)))
    for sp, src, dst in ((False, "sp", "nosp"), (True, "nosp", None)):
        cfg, rng, model, eng = engine(sp, 99)  # another seed: everything comes from the file
        assert load_checkpoint(f"{tmp}/{src}", eng, ps, cfg.seed, rng, V) == (2, 4)
        if dst:
            save_checkpoint(f"{tmp}/{dst}", 2, 4, eng, ps, cfg.to_dict(), rng, vocab_size=V)
        out.append((params(model, eng), step(model, eng)))
    return out


def test_checkpoint_round_trip_between_sp_on_and_off(tmp_path):
    """SP changes no parameter: a checkpoint saved with SP loads without it and back,
    bit for bit (TP 2, ZeRO-3), and the next step's loss agrees within 1e-6."""
    res = run_ranks(_sp_checkpoint_round_trip, world_size=2, tp=2, args=(str(tmp_path),))
    for rank in res:
        (ref, loss), *loaded = rank
        for params, next_loss in loaded:
            for name, p in ref.items():
                assert torch.equal(params[name], p), name
            assert abs(next_loss - loss) <= 1e-6 * abs(loss)
