"""hybrid's sigmoid router computes DeepSeek-V3's routing: ``models.moe.Router`` built from
Megatron's flags (``--moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-num-groups G --moe-router-group-topk P --moe-router-topk-scaling-factor S``)
picks, for every token, the same set of experts as transformers' ``DeepseekV3TopkRouter``
holding the same weight and the same ``e_score_correction_bias`` as ``expert_bias``, and
gives each (token, expert) the same gate within 1e-6 (``norm_topk_prob`` true, gates
times ``routed_scaling_factor``). Held on a small config and on DeepSeek-V3's own routing
shape (256 experts, 8 a token, 8 groups, 4 picked), on random tokens, zero tokens (every
score 0.5: the bias alone ranks) and tokens whose scores tie exactly in pairs.

The group rule: transformers scores a group by the sum of its top 2 biased scores
(DeepSeek-V3's reference code); hybrid, as Megatron, by the sum of its top ``k // P``.
The two agree when ``k // P == 2``, which both configs here have (4 // 2, 8 // 4); for
another ``k // P`` they differ, and the last test pins that difference so that a change
to either rule shows. ``norm_topk_prob`` false (raw sigmoid gates) is not held: hybrid
always scales the chosen sigmoid scores to sum to 1, so nothing is asserted for it.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.config.moe import MoEConfig
from models.moe import Router

transformers = pytest.importorskip("transformers")
deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

HIDDEN = 64
SMALL = {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2}
DSV3 = {"n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4}


def _pair(shape: dict, seed: int, scaling: float = 2.5, tied: bool = False):
    """transformers' router and hybrid's, with one random weight and one random non-zero
    bias. ``tied``: experts 2j and 2j+1 share their weight row and bias, so every score
    ties with its neighbour's; a group holds whole pairs and k is even, so the chosen
    set is the same whichever of two tied experts a kernel lists first."""
    cfg = transformers.DeepseekV3Config(hidden_size=HIDDEN, norm_topk_prob=True,
                                        routed_scaling_factor=scaling, **shape)
    hf = deepseek.DeepseekV3TopkRouter(cfg)
    E = shape["n_routed_experts"]
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(E, HIDDEN, generator=g) * 0.3  # logits of a few units: sigmoid not flat
    # of the order of the gaps between neighbouring scores: it moves some choices (checked)
    bias = torch.randn(E, generator=g) * 0.1
    if tied:
        weight, bias = weight[::2].repeat_interleave(2, 0), bias[::2].repeat_interleave(2)
    with torch.no_grad():
        hf.weight.copy_(weight)
        hf.e_score_correction_bias.copy_(bias)
    moe = MoEConfig(num_experts=E, moe_router_topk=shape["num_experts_per_tok"],
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_num_groups=shape["n_group"],
                    moe_router_group_topk=shape["topk_group"],
                    moe_router_topk_scaling_factor=scaling)
    assert moe.num_experts is not None
    ours = Router(HIDDEN, moe.num_experts, moe.moe_router_topk,
                  score=moe.moe_router_score_function,
                  topk_scaling=moe.moe_router_topk_scaling_factor, groups=moe.router_groups)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ours.expert_bias.copy_(bias)
    return hf, ours


def _tokens(seed: int, n: int = 64) -> torch.Tensor:
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))
    x[:4] = 0  # every score 0.5: only the bias ranks the experts
    return x


def _by_expert(experts: torch.Tensor, gates: torch.Tensor):
    """Each token's experts in index order, with their gates: transformers lists them in
    no defined order (an unsorted top k), hybrid largest first."""
    order = experts.argsort(dim=-1)
    return experts.gather(1, order), gates.gather(1, order)


def _compare(hf, ours, x):
    """(the sets equal for every token, the largest gate difference, hybrid's Routing)."""
    with torch.no_grad():
        _, hf_gates, hf_experts = hf(x)
        r = ours(x)
    hf_e, hf_g = _by_expert(hf_experts, hf_gates)
    our_e, our_g = _by_expert(r.experts, r.gates)
    same = bool(torch.equal(hf_e, our_e))
    diff = (hf_g - our_g).abs().max().item() if same else float("inf")
    return same, diff, r


@pytest.mark.parametrize("shape", [SMALL, DSV3], ids=["small", "deepseek_v3"])
@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied_pairs"])
def test_sigmoid_router_matches_deepseek_v3(shape, tied):
    """The same experts per token and gates within 1e-6 (the module docstring)."""
    hf, ours = _pair(shape, seed=1, tied=tied)
    x = _tokens(seed=2)
    same, diff, r = _compare(hf, ours, x)
    assert same, "chosen experts differ"
    assert diff <= 1e-6, diff
    # gates sum to the scaling factor (norm_topk_prob, then routed_scaling_factor)
    torch.testing.assert_close(r.gates.sum(-1), torch.full((len(x),), 2.5))
    if tied:
        return
    # the test means something: the bias and the groups each change some token's choice.
    # (Not with tied pairs: a group's top-2 score is then its best pair's, and a token's
    # best k / 2 pairs always lie in its best P groups, so the groups never bind.)
    k = shape["num_experts_per_tok"]
    free = Router(HIDDEN, shape["n_routed_experts"], k, score="sigmoid", topk_scaling=2.5)
    with torch.no_grad():
        free.weight.copy_(ours.weight)
        free.expert_bias.copy_(ours.expert_bias)
        ungrouped = free(x).experts.sort(-1).values
        ours.expert_bias.zero_()
        unbiased = ours(x).experts.sort(-1).values
    chosen = r.experts.sort(-1).values
    assert (unbiased != chosen).any(-1).sum() >= 4, "the bias moves no choice"
    assert (ungrouped != chosen).any(-1).sum() >= 4, "the groups move no choice"


def test_group_rules_differ_when_k_over_p_is_not_2():
    """4 experts a token from 4 of 8 groups: hybrid (Megatron) scores a group by its top
    1 score, transformers (DeepSeek-V3) by its top 2, and some tokens get other experts.
    Should either rule change, this fails and the module docstring is to be updated."""
    shape = {"n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 8, "topk_group": 4}
    hf, ours = _pair(shape, seed=5)
    same, _, _ = _compare(hf, ours, _tokens(seed=6, n=256))
    assert not same
