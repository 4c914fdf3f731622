"""The Llama-family options: each one (and all together) is the same function at every
TP size, composes with ZeRO, recompute and sequence parallelism, and reshards.

* At TP 2 and 4 the init is bit-identical to the one-process model's and the
  logits, loss and gradients agree (one launch per TP size checks every option).
* A Llama-shaped model (RMSNorm, SwiGLU, RoPE, GQA, untied, no biases) trains
  2 steps at TP2 x DP2 and TP4 x DP1 under ZeRO 0-3, full and selective
  recompute and SP with the losses and parameters of plain torch on one process.
* A checkpoint saved at TP 2 loads at TP 1 and the reverse, bit for bit, with
  the same loss (Qwen2-shaped: with the QKV bias).

The flags themselves are in tests/config/test_llama_flags.py.
"""

import pytest
import torch

from hybrid.config import Flags, build_config
from hybrid.config.model import ModelConfig
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import full_shape, seed_all, shard_of, unshard
from models.gpt import GPT
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import (
    BUCKETS,
    VOCAB,
    _named_params,
    _train_cfg,
    _train_reference,
    _train_steps,
)

SEED, V, T = 13, 257, 16
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             num_query_groups=4, untie_embeddings_and_output_weights=True,
             add_bias_linear=False)
OPTIONS = {  # name -> ModelConfig fields; 8 heads of 8 channels, 4 query groups
    "rmsnorm": {"normalization": "RMSNorm"},
    "swiglu": {"swiglu": True},
    "rope": {"position_embedding_type": "rope", "rotary_base": 500.0},
    "rope_partial": {"position_embedding_type": "rope", "rotary_percent": 0.5},
    # base 1e6 on 8 channels: wavelengths 6, 199, 6283 and 198,692 tokens, one in each
    # regime of Llama-3.1's scaling (kept, blended, divided by the factor)
    "rope_scaled": {"position_embedding_type": "rope", "rotary_base": 1e6,
                    "rope_scaling_factor": 8.0},
    "rope_interpolated": {"position_embedding_type": "rope",
                          "rotary_seq_len_interpolation_factor": 4.0},
    "no_positions": {"position_embedding_type": "none"},
    "gqa": {"num_query_groups": 4},
    "untied": {"untie_embeddings_and_output_weights": True},
    "no_bias": {"add_bias_linear": False},
    # Qwen2: only QKV has a bias, laid out per query group (4 groups: one per rank at
    # TP 4), added before RoPE rotates q and k (as "gqa" with zero biases elsewhere)
    "qkv_bias": {"add_bias_linear": False, "add_qkv_bias": True, "num_query_groups": 4,
                 "position_embedding_type": "rope"},
    "llama": LLAMA,
    "qwen2": dict(LLAMA, add_qkv_bias=True),
    # Qwen3: heads 16 wide (--kv-channels; 8 x 16 = 128, not the hidden 64) and their
    # q and k normalized before RoPE (--qk-layernorm), weights replicated over TP
    "qwen3": dict(LLAMA, kv_channels=16, qk_layernorm=True),
}


def _cfg(**kw):
    # vocab 257, padded by GPT per TP size (384 / 512 / 512)
    return ModelConfig(vocab_size=V, num_layers=2, hidden_size=64, num_attention_heads=8,
                       max_position_embeddings=T, hidden_dropout=0.0, attention_dropout=0.0,
                       **kw)


def _batch():
    x = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(4))
    return x[:, :-1], x[:, 1:]


def _nonzero_qkv_bias(model):
    """Biases start at zero, which hides their layout: give every QKV bias one full
    value per row (the same at every TP size) and keep this rank's rows of it. The
    q and k norms' weights start at one, which would hide a norm applied to the wrong
    heads: each gets its own values too (replicated, the same on every rank)."""
    for layer, block in enumerate(model.blocks):
        p = block.attn.qkv.bias
        g = torch.Generator().manual_seed(100 + layer)
        if p is not None:
            with torch.no_grad():
                p.copy_(shard_of(0.5 * torch.randn(full_shape(p), generator=g), p))
        for norm in (block.attn.q_norm, block.attn.k_norm):
            if norm is not None:
                with torch.no_grad():
                    norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))


def _run_options(ps, names):
    out = {}
    for name in names:
        rng = seed_all(SEED, ps.tp_rank, ps.dp_rank, ps.device)
        model = GPT(_cfg(**OPTIONS[name]), ps.tp_group, rng=rng, seed=SEED)
        _nonzero_qkv_bias(model)
        x, y = _batch()
        logits = model(x)
        loss = model(x, y)
        loss.backward()
        out[name] = {"logits": logits.detach(), "loss": loss.detach(),
                     "weights": {n: p.detach() for n, p in model.named_parameters()},
                     "grads": {n: p.grad for n, p in model.named_parameters()},
                     "specs": {n: getattr(p, "tp_spec", None)
                               for n, p in model.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def reference():
    return _run_options(ParallelState.single(), list(OPTIONS))


def test_options_change_the_model_they_name(reference):
    names = {k: set(r["weights"]) for k, r in reference.items()}
    base = names["rmsnorm"]
    assert "wpe.weight" not in names["rope"] | names["no_positions"] | names["llama"]
    assert "output_layer.weight" in names["untied"] - base
    linear_bias = [n for n in names["no_bias"] if n.endswith("bias") and "ln_" not in n]
    assert not linear_bias and not any(n.endswith("bias") for n in names["llama"])
    assert not any("ln_1.bias" in n for n in base)  # RMSNorm: a weight only
    for name in ("qkv_bias", "qwen2"):  # the QKV bias and no other
        assert sorted(n for n in names[name] if n.endswith("bias") and "ln_" not in n) == \
            ["blocks.0.attn.qkv.bias", "blocks.1.attn.qkv.bias"], name
    assert reference["qwen2"]["weights"]["blocks.0.attn.qkv.bias"].shape == ((8 + 2 * 4) * 8,)
    w = reference["llama"]["weights"]
    assert w["blocks.0.mlp.fc.weight"].shape == (2 * 128, 64)  # [gate; up], 8h/3 -> 128
    assert w["blocks.0.attn.qkv.weight"].shape == ((8 + 2 * 4) * 8, 64)
    assert reference["llama"]["specs"]["blocks.0.mlp.fc.weight"].full_shape == (2, 128, 64)
    losses = {k: float(r["loss"]) for k, r in reference.items()}
    assert len(set(losses.values())) == len(losses), losses  # each option does something
    w = reference["qwen3"]["weights"]  # (8 + 2 x 4) heads of 16 channels, 128 -> 64
    assert w["blocks.0.attn.qkv.weight"].shape == ((8 + 2 * 4) * 16, 64)
    assert w["blocks.0.attn.proj.weight"].shape == (64, 8 * 16)
    assert w["blocks.1.attn.q_norm.weight"].shape == w["blocks.1.attn.k_norm.weight"].shape \
        == (16,)
    for name in ("llama", "qwen2", "qkv_bias", "qwen3"):
        cfg = _cfg(**OPTIONS[name])
        assert cfg.num_parameters() == sum(p.numel() for p in reference[name]["weights"].values())


@pytest.mark.parametrize("tp", [2, 4])
def test_every_option_is_the_same_function_at_tp(reference, tp):
    """Bit-identical init (full tensors from the TP slices), and logits, loss and
    gradients of the one-process model, for each option and all together."""
    res = run_ranks(_run_options, world_size=tp, tp=tp, args=(list(OPTIONS),))
    for name, ref in reference.items():
        ranks = [r[name] for r in res]
        logits = torch.cat([r["logits"] for r in ranks], dim=-1)
        torch.testing.assert_close(logits[..., :V], ref["logits"][..., :V], rtol=1e-5,
                                   atol=1e-5, msg=lambda m, name=name: f"{name} TP{tp}: {m}")
        assert torch.isinf(logits[..., V:]).all()
        for r in ranks:
            assert abs(float(r["loss"]) - float(ref["loss"])) <= 1e-5 * float(ref["loss"])
        for pname, spec in ranks[0]["specs"].items():
            w = unshard([r["weights"][pname] for r in ranks], spec)
            g = unshard([r["grads"][pname] for r in ranks], spec)
            ref_w, ref_g = ref["weights"][pname], ref["grads"][pname]
            if pname in ("wte.weight", "output_layer.weight"):  # padding rows: count differs
                assert not w[V:].any()
                w, g, ref_w, ref_g = w[:V], g[:V], ref_w[:V], ref_g[:V]
            assert torch.equal(w, ref_w.reshape(w.shape)), f"{name}: init of {pname} at TP{tp}"
            torch.testing.assert_close(
                g, ref_g.reshape(g.shape), rtol=1e-5, atol=1e-6,
                msg=lambda m, name=name, pname=pname: f"{name} TP{tp} grad of {pname}: {m}")


def _qwen3_sp(ps):
    rng = seed_all(SEED, ps.tp_rank, ps.dp_rank, ps.device)
    model = GPT(_cfg(**OPTIONS["qwen3"]), ps.tp_group, rng=rng, seed=SEED,
                sequence_parallel=True)
    _nonzero_qkv_bias(model)
    x, y = _batch()
    loss = model(x, y)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()},
            "specs": {n: getattr(p, "tp_spec", None) for n, p in model.named_parameters()}}


def test_qwen3_attention_is_the_same_function_at_tp2_with_sequence_parallelism(reference):
    """--kv-channels and --qk-layernorm under SP at TP 2: the one-process loss and
    gradients to 1e-6, the q and k norms' gradients summed over TP (equal on both
    ranks, each rank having normalized other heads)."""
    ref = reference["qwen3"]
    res = run_ranks(_qwen3_sp, world_size=2, tp=2)
    for r in res:
        assert abs(float(r["loss"]) - float(ref["loss"])) <= 1e-6
    for pname, spec in res[0]["specs"].items():
        g = unshard([r["grads"][pname] for r in res], spec)
        ref_g = ref["grads"][pname]
        if pname in ("wte.weight", "output_layer.weight"):
            g, ref_g = g[:V], ref_g[:V]
        torch.testing.assert_close(g, ref_g.reshape(g.shape), rtol=0, atol=1e-6,
                                   msg=lambda m, pname=pname: f"grad of {pname}: {m}")
        if pname.endswith(("q_norm.weight", "k_norm.weight")):
            assert spec is None and torch.equal(res[0]["grads"][pname], res[1]["grads"][pname])


# -- the ops' own backward passes ---------------------------------------------------------
def test_llama_ops_backward_is_the_derivative_of_their_forward():
    """RMSNorm, SwiGLU and the QKV split with full and partial RoPE define their own
    backward (saving less than autograd would): gradcheck in fp64, and the forward
    against the plain formulas (GPT-2-style views when there is nothing to rotate)."""
    from hybrid.kernels.rms_norm import rms_norm
    from hybrid.kernels.rotary import Rotary, split_qkv
    from hybrid.kernels.swiglu import swiglu
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 12, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (x, w))
    assert torch.autograd.gradcheck(swiglu, (x,))
    torch.testing.assert_close(rms_norm(x, w, 1e-5),
                               w * x * (x.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt())
    a, b = x.chunk(2, -1)
    torch.testing.assert_close(swiglu(x), torch.nn.functional.silu(a) * b)
    qkv = torch.randn(2, 5, 2 * (3 + 2) * 4, dtype=torch.float64, generator=g,
                      requires_grad=True)  # 2 groups of 3 query heads, head size 4
    for rot in (None, Rotary(4, 100.0), Rotary(2, 100.0)):
        assert torch.autograd.gradcheck(lambda t, rot=rot: split_qkv(t, 3, 4, rot), (qkv,))
    q, k, v = split_qkv(qkv, 3, 4, None)
    heads = qkv.detach().view(2, 5, 2, 5, 4)
    assert torch.equal(q[:, 4], heads[:, :, 1, 1].contiguous())  # group 1, query head 1
    assert torch.equal(k[:, 1], heads[:, :, 1, 3]) and torch.equal(v[:, 0], heads[:, :, 0, 4])
    # RoPE turns channel pair (j, j + 2) of position p by p * 100^(-j/2)
    q, k, _ = split_qkv(qkv, 3, 4, Rotary(4, 100.0))
    x0, x2 = heads[1, 3, 0, 0, 1], heads[1, 3, 0, 0, 3]
    angle = torch.tensor(3 * 100.0 ** -0.5, dtype=torch.float64)
    torch.testing.assert_close(q[1, 0, 3, 1], x0 * angle.cos() - x2 * angle.sin(), rtol=1e-6,
                               atol=1e-7)
    torch.testing.assert_close(q[1, 0, 3, 3], x2 * angle.cos() + x0 * angle.sin(), rtol=1e-6,
                               atol=1e-7)


# -- training: ZeRO, recompute, SP ------------------------------------------------------
LLAMA_FLAGS = dict(normalization="RMSNorm", swiglu=True, ffn_hidden_size=64,
                   position_embedding_type="rope", group_query_attention=True,
                   num_query_groups=4, untie_embeddings_and_output_weights=True,
                   disable_bias_linear=True, num_attention_heads=8)
SP = {"sequence_parallel": True}
FULL, SELECTIVE = {"recompute_granularity": "full"}, {"recompute_granularity": "selective"}
# at TP4 x DP1 the global batch of 8 in 2 micro-batches of 4 (not 4 of 2): accumulation
# all the same, half the micro-batches' TP collective rounds (against the one-process
# run's 4 of 2: the same mean loss)
MICRO4 = {"micro_batch_size": 4}
COMPOSE = {
    2: [(0, {}), (1, SELECTIVE), (2, {**SP, "overlap_comm": True}), (3, {**SP, **FULL}),
        (3, {**SP, **SELECTIVE, "zero_param_persistence_threshold": 100})],
    4: [(1, {**SP, **MICRO4}), (3, {**SP, **FULL, **MICRO4})],
}


# the curves compared with the one-process run: 2 steps, the second on the first's Adam
# moments (and at ZeRO 3 on parameters the first step's shards updated and gathered anew)
STEPS = 2


def _train_llama(ps, variants):
    from hybrid.train.setup import build_engine
    out = []
    for stage, kw in variants:
        cfg = _train_cfg(ps.world_size, ps.tp_size, zero_stage=stage, **LLAMA_FLAGS,
                         **BUCKETS, **kw)
        rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
        model, _, engine = build_engine(cfg, ps, VOCAB, rng)
        losses, norms = _train_steps(model, engine, ps, cfg, STEPS)
        params = _named_params(model, engine)
        specs = {n: getattr(p, "tp_spec", None) for n, p in model.named_parameters()}
        out.append({"losses": losses, "norms": norms, "params": params, "specs": specs})
    return out


@pytest.fixture(scope="module")
def llama_reference():
    from hybrid.train.setup import build_model
    cfg = _train_cfg(1, 1, **LLAMA_FLAGS)
    ps = ParallelState.single()
    model = build_model(cfg, ps, VOCAB, seed_all(cfg.seed, 0, 0, ps.device))
    return _train_reference(model, cfg, STEPS)


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_trains_like_one_process_under_zero_recompute_and_sp(llama_reference, tp):
    """2 AdamW steps with clipping and 2 micro-batches per step (of 2 rows where DP is
    2, of 4 at TP4 x DP1), buckets of 4000 (zero_reference.BUCKETS): the losses, clipped
    grad norms and final parameters of the one-process plain-torch run (4 micro-batches
    of 2), at ZeRO 0-3, with full and selective recompute and sequence parallelism."""
    variants = COMPOSE[tp]
    res = run_ranks(_train_llama, world_size=4, tp=tp, args=(variants,))
    ref = llama_reference
    for v, variant in enumerate(variants):
        got = res[0][v]
        assert len(got["losses"]) == len(ref["losses"]) == STEPS, variant
        for a, b in zip(got["losses"] + got["norms"], ref["losses"] + ref["norms"]):
            assert abs(a - b) <= 1e-5 * abs(b), (variant, got["losses"], ref["losses"])
        for name, want in ref["params"].items():
            if got["specs"][name] is None:  # replicated (RMSNorm): equal on every rank
                for r in res[1:]:
                    assert torch.equal(r[v]["params"][name], got["params"][name]), (variant, name)
            full = unshard([res[t][v]["params"][name] for t in range(tp)], got["specs"][name])
            expect = want
            if name in ("wte.weight", "output_layer.weight"):
                full, expect = full[:VOCAB], want[:VOCAB]
            expect = expect.reshape(full.shape)
            rel = float((full - expect).norm() / expect.norm())
            assert rel <= 1e-5, (variant, name, rel)


# -- checkpoints across TP sizes --------------------------------------------------------
def _engine(ps, seed):
    """Qwen2-shaped: the Llama flags and --add-qkv-bias (a bias that training moves)."""
    from hybrid.train.setup import build_engine
    cfg = build_config(Flags(tensor_model_parallel_size=ps.tp_size, num_layers=2, hidden_size=32,
                seq_length=T, zero_stage=1 if ps.world_size > 1 else 0, seed=seed,
                hidden_dropout=0.0, attention_dropout=0.0, add_qkv_bias=True, **LLAMA_FLAGS,
                ), ps.world_size)
    rng = seed_all(seed, ps.tp_rank, ps.dp_rank, ps.device)
    model, _, engine = build_engine(cfg, ps, V, rng)
    return cfg, rng, model, engine


def _loss(model):
    x = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        return float(model(x[:, :-1], x[:, 1:]))


def _train_save_load(ps, save_dir, load_dir):
    """Train 2 steps from seed 3 and save to ``save_dir``; then (if given) load
    ``load_dir`` into a model from another seed. (loss after training, full
    params; loss after loading, full params)."""
    from hybrid.checkpoint import load_checkpoint, save_checkpoint
    cfg, rng, model, engine = _engine(ps, 3)
    for _ in range(2):
        x = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(5))
        engine.zero_grad()
        engine.backward(model(x[:, :-1], x[:, 1:]))
        engine.step(1e-2)
    save_checkpoint(save_dir, 2, 4, engine, ps, cfg.to_dict(), rng, vocab_size=V)
    trained = (_loss(model), _named_params(model, engine),
               {n: getattr(p, "tp_spec", None) for n, p in model.named_parameters()})
    if load_dir is None:
        return trained, None
    cfg, rng, model, engine = _engine(ps, 99)
    assert load_checkpoint(load_dir, engine, ps, cfg.seed, rng, V) == (2, 4)
    return trained, (_loss(model), _named_params(model, engine))


def _same(a, b, specs_a):
    for name, p in b.items():
        full = unshard(a[name], specs_a[name]) if isinstance(a[name], list) else a[name]
        want = p
        if name in ("wte.weight", "output_layer.weight"):
            full, want = full[:V], p[:V]
        assert torch.equal(full, want.reshape(full.shape)), name


def test_checkpoints_reshard_between_tp1_and_tp2(tmp_path):
    """Saved at TP 1 and loaded at TP 2, and saved at TP2 x DP1 (ZeRO-1) and loaded
    at TP 1: the full parameters bit for bit (the trained QKV bias too), and the same
    loss."""
    one, two = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    (loss1, params1, _), _ = _train_save_load(ParallelState.single(), one, None)
    assert params1["blocks.1.attn.qkv.bias"].abs().min() > 0
    res = run_ranks(_train_save_load, world_size=2, tp=2, args=(two, one))
    (loss2, _, specs2), (loaded_loss, _) = res[0]
    params2 = {n: [r[0][1][n] for r in res] for n in res[0][0][1]}
    loaded_at_2 = {n: [r[1][1][n] for r in res] for n in res[0][1][1]}
    _same(loaded_at_2, params1, specs2)  # TP1 -> TP2
    assert abs(loaded_loss - loss1) <= 1e-6 * loss1
    from hybrid.checkpoint import load_checkpoint
    ps = ParallelState.single()
    cfg, rng, model, engine = _engine(ps, 99)
    assert load_checkpoint(two, engine, ps, cfg.seed, rng, V) == (2, 4)  # TP2 -> TP1
    _same(params2, _named_params(model, engine), specs2)
    assert abs(_loss(model) - loss2) <= 1e-6 * loss2
    # the Llama checkpoint into a GPT-2 of the same size: refused, naming the flags
    from hybrid.errors import CheckpointError
    from hybrid.train.setup import build_engine
    gpt2 = build_config(Flags(num_layers=2, hidden_size=32, num_attention_heads=8, seq_length=T,
                       ffn_hidden_size=64), 1)
    rng = seed_all(3, 0, 0, ps.device)
    _, _, engine = build_engine(gpt2, ps, V, rng)
    with pytest.raises(CheckpointError, match="the architecture flags"):
        load_checkpoint(one, engine, ps, gpt2.seed, rng, V)
