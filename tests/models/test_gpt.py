"""GPT at TP=2 and 4 computes the same logits, loss and gradients as TP=1 from the same seed."""

from dataclasses import replace

import pytest
import torch

from hybrid.config.model import ModelConfig
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import seed_all
from models.gpt import GPT
from tests.helpers.harness import run_ranks

SEED = 7


def _cfg(dropout=0.0):
    # vocab 257, padded by GPT per TP size (384 / 512 / 512): padding must not change
    # the function
    return ModelConfig(vocab_size=257, num_layers=2, hidden_size=32, num_attention_heads=4,
                       max_position_embeddings=16, hidden_dropout=dropout,
                       attention_dropout=dropout)


def _tokens():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 257, (2, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _mask(x):
    return (x % 3 != 0).float()


def _run_gpt(ps):
    rng = seed_all(SEED, ps.tp_rank, ps.dp_rank, ps.device)
    model = GPT(_cfg(), ps.tp_group, rng=rng, seed=SEED)
    assert model.padded_vocab_size == {1: 384, 2: 512, 4: 512}[ps.tp_size]
    x, y = _tokens()
    logits = model(x)
    loss = model(x, y)
    loss.backward()
    with torch.no_grad():  # --eod-mask-loss's path, with every third id as the "end"
        masked = model(x, y, _mask(x)).detach()
        nothing = model(x, y, torch.zeros_like(_mask(x))).detach()
    grads = {n: p.grad for n, p in model.named_parameters()}
    specs = {n: getattr(p, "tp_spec", None) for n, p in model.named_parameters()}
    weights = {n: p.detach() for n, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads,
            "masked": masked, "nothing": nothing,
            "weights": weights, "specs": specs}


def _gather(per_rank, key, name, spec):
    if spec is None:
        return per_rank[0][key][name]
    return torch.cat([r[key][name] for r in per_rank], dim=spec.dim)


@pytest.fixture(scope="module")
def reference():
    return _run_gpt(ParallelState.single())


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_tp_matches_single_process(reference, tp):
    res = run_ranks(_run_gpt, world_size=tp, tp=tp)
    V = 257
    full_logits = torch.cat([r["logits"] for r in res], dim=-1)
    torch.testing.assert_close(full_logits[..., :V], reference["logits"][..., :V],
                               rtol=1e-5, atol=1e-5)
    assert torch.isinf(full_logits[..., V:]).all(), "padded vocabulary must be masked"
    for r in res:
        torch.testing.assert_close(r["loss"], reference["loss"], rtol=1e-5, atol=1e-6)
    for name, spec in res[0]["specs"].items():
        w = _gather(res, "weights", name, spec)
        ref_w = reference["weights"][name]
        if name == "wte.weight":  # padded rows differ in count only; real rows identical
            assert torch.equal(w[:V], ref_w[:V]) and not w[V:].any()
            g, ref_g = _gather(res, "grads", name, spec)[:V], reference["grads"][name][:V]
        else:
            assert torch.equal(w, ref_w), f"init of {name} depends on the layout"
            g, ref_g = _gather(res, "grads", name, spec), reference["grads"][name]
        torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-6, msg=f"grad of {name}")
        if spec is None:  # replicated params: every TP rank holds the same gradient
            for r in res[1:]:
                torch.testing.assert_close(r["grads"][name], res[0]["grads"][name],
                                           rtol=1e-6, atol=1e-7)


def test_gpt_rejects_heads_not_divisible_by_tp():
    cfg = replace(_cfg(), num_attention_heads=3, hidden_size=33)
    ps = ParallelState.single()
    GPT(cfg, ps.tp_group)  # fine at TP=1

    class FakeTP:
        size, rank = 2, 0
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        GPT(cfg, FakeTP())


def test_padding_rows_get_no_gradient(reference):
    g = reference["grads"]["wte.weight"]
    assert g[257:].abs().sum() == 0 and g[:257].abs().sum() > 0


def test_a_loss_mask_averages_the_kept_tokens_only(reference):
    """The masked loss is the mean cross-entropy of the kept tokens (a mask of zeros:
    0, not 0/0), the same at TP 2 as in one process."""
    import torch.nn.functional as F
    x, y = _tokens()
    per_token = F.cross_entropy(reference["logits"][..., :257].reshape(-1, 257), y.reshape(-1),
                                reduction="none")
    keep = _mask(x).reshape(-1)
    assert 0 < keep.sum() < keep.numel()
    want = (per_token * keep).sum() / keep.sum()
    torch.testing.assert_close(reference["masked"], want, rtol=1e-6, atol=0)
    assert abs(float(reference["masked"] - reference["loss"])) > 1e-3  # the mask matters
    assert float(reference["nothing"]) == 0.0
    for r in run_ranks(_run_gpt, world_size=2, tp=2):
        torch.testing.assert_close(r["masked"], reference["masked"], rtol=1e-5, atol=1e-5)
