"""models/moe.py on one process: the layer against a token-by-token reference (output and
every gradient), the router's choices (ties to the lower expert, the gate rules), an
expert without tokens, the load-balancing loss's values, and the block's MoE layer: its
losses' gradient that of adding them to the loss, times the step's factor, its
statistics counted once per backward and never in evaluation."""

import pytest
import torch
import torch.nn.functional as F

from models.moe import (
    AuxLossScale,
    MoE,
    MoELayer,
    Router,
    router_z_loss,
    seq_aux_loss,
    switch_aux_loss,
)


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: each token's chosen experts, in gate order, from the same weights
    (the router's decision taken as given: its gates carry the gradient)."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = moe.router(tokens)
    outs = []
    for t in range(tokens.shape[0]):
        y = 0
        for j in range(routing.experts.shape[1]):
            e = int(routing.experts[t, j])
            h = tokens[t] @ moe.fc[e].t()
            if moe.swiglu:
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h)
            y = y + (h @ moe.proj[e].t()) * routing.gates[t, j]
        outs.append(y)
    return torch.stack(outs).view(x.shape)


@pytest.mark.parametrize("swiglu,pre_softmax,score", [
    (False, False, "softmax"), (True, False, "softmax"), (False, True, "softmax"),
    (False, False, "sigmoid")])
def test_the_layer_is_its_token_by_token_reference(swiglu, pre_softmax, score):
    torch.manual_seed(0)
    moe = MoE(16, 24, num_experts=6, top_k=2, swiglu=swiglu, pre_softmax=pre_softmax,
              score=score, init_method_std=0.2).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    y, routing = moe(x)
    want = _reference(moe, x)
    assert y.shape == x.shape and routing.experts.shape == (15, 2)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, moe.fc, moe.proj, moe.router.weight], g)
    ref = torch.autograd.grad(want, [x, moe.fc, moe.proj, moe.router.weight], g)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert got[3].abs().sum() > 0  # the router learns through its gates


def test_equal_scores_go_to_the_lower_expert_and_the_gates_follow_their_rule():
    router = Router(4, num_experts=5, top_k=3)
    torch.nn.init.zeros_(router.weight)  # every logit 0: every expert ties
    r = router(torch.randn(7, 4))
    assert r.experts.tolist() == [[0, 1, 2]] * 7
    torch.testing.assert_close(r.gates, torch.full((7, 3), 1 / 3))  # softmax over the top 3
    assert r.tokens_per_expert.tolist() == [7, 7, 7, 0, 0]
    pre = Router(4, num_experts=5, top_k=3, pre_softmax=True)
    torch.nn.init.zeros_(pre.weight)
    torch.testing.assert_close(pre(torch.randn(7, 4)).gates, torch.full((7, 3), 1 / 5))


def test_an_expert_without_tokens_gets_a_zero_gradient():
    torch.manual_seed(1)
    moe = MoE(8, 12, num_experts=4, top_k=1)
    with torch.no_grad():  # the router sends every token to expert 2
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0
    x = torch.rand(10, 8) + 0.1  # positive: expert 2's logit is the largest
    y, routing = moe(x)
    assert routing.tokens_per_expert.tolist() == [0, 0, 10, 0]
    y.sum().backward()
    for e in (0, 1, 3):
        assert torch.count_nonzero(moe.fc.grad[e]) == 0
        assert torch.count_nonzero(moe.proj.grad[e]) == 0
    assert torch.count_nonzero(moe.fc.grad[2]) > 0


def test_the_load_balancing_loss_is_one_when_uniform_and_more_when_not():
    router = Router(4, num_experts=4, top_k=2)
    torch.nn.init.zeros_(router.weight)
    uniform = router(torch.randn(8, 4))
    # every probability 1/4 but the ties send all to experts 0 and 1: f = (1/2, 1/2, 0, 0)
    assert float(switch_aux_loss(uniform).detach()) == pytest.approx(1.0)
    torch.manual_seed(2)
    skewed = Router(4, num_experts=4, top_k=1)
    with torch.no_grad():
        skewed.weight.zero_()
        skewed.weight[0] = 5.0
    r = skewed(torch.rand(16, 4) + 0.5)  # all to expert 0, which also has most probability
    loss = switch_aux_loss(r)
    assert r.tokens_per_expert.tolist() == [16, 0, 0, 0]
    value = float(loss.detach())
    assert value == pytest.approx(4 * float(r.probs[:, 0].mean().detach()))
    assert value > 3.5
    loss.backward()
    assert skewed.weight.grad.abs().sum() > 0  # through the mean probabilities


def test_top_k_outside_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"top_k 5 must be in \[1, num_experts 4\]"):
        Router(8, num_experts=4, top_k=5)


def test_a_sigmoid_router_s_bias_moves_the_choice_not_the_gates():
    """DeepSeek-V3's routing: the expert bias ranks, the unbiased scores weigh (summing to
    1 over the chosen), and the bias moves toward the mean load."""
    torch.manual_seed(3)
    router = Router(8, num_experts=4, top_k=2, score="sigmoid")
    torch.nn.init.normal_(router.weight)
    x = torch.randn(6, 8)
    plain = router(x)
    torch.testing.assert_close(plain.gates.sum(-1), torch.ones(6))
    router.expert_bias[3] = 100.0  # expert 3 now wins every token's first place
    biased = router(x)
    assert biased.experts[:, 0].tolist() == [3] * 6
    scores = torch.sigmoid(F.linear(x, router.weight))
    top = scores.gather(1, biased.experts)
    torch.testing.assert_close(biased.gates, top / top.sum(-1, keepdim=True))
    router.expert_bias.zero_()
    router.update_expert_bias(torch.tensor([9, 1, 1, 1]), rate=0.5)  # mean 3
    assert router.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    assert "expert_bias" in router.state_dict() and not router.expert_bias.requires_grad


def test_the_router_z_loss_is_the_mean_squared_log_sum_exp():
    router = Router(4, num_experts=8, top_k=2)
    torch.nn.init.zeros_(router.weight)  # every logit 0: logsumexp = log 8
    z = router_z_loss(router(torch.randn(5, 4)))
    assert float(z.detach()) == pytest.approx(torch.log(torch.tensor(8.0)).item() ** 2)


def test_a_router_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="score 'relu' must be one of"):
        Router(8, num_experts=4, top_k=1, score="relu")
    with pytest.raises(ValueError, match="pre_softmax is a softmax router's"):
        Router(8, num_experts=4, top_k=1, pre_softmax=True, score="sigmoid")


def _all_to_expert_0(moe: MoE) -> None:
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_a_capacity_drops_what_its_policy_drops_and_computes_the_rest(policy):
    """Every token to expert 0 (top 1, gates from a softmax over all experts, so they
    differ), 8 tokens, capacity ceil(8 x 1 / 2 x 1.0) = 4: "position" keeps tokens 0-3,
    "probs" the 4 largest gates; a dropped token's output is 0, a kept one's is the
    dropless layer's."""
    torch.manual_seed(4)
    dropless = MoE(6, 10, num_experts=2, top_k=1, pre_softmax=True, init_method_std=0.3)
    _all_to_expert_0(dropless)
    capped = MoE(6, 10, num_experts=2, top_k=1, pre_softmax=True, capacity_factor=1.0,
                 drop_policy=policy)
    capped.load_state_dict(dropless.state_dict())
    x = torch.rand(8, 6) + 0.1
    want, routing = dropless(x)
    y, capped_routing = capped(x)
    assert routing.tokens_per_expert.tolist() == [8, 0]
    gates = routing.gates[:, 0]
    largest = gates.detach().argsort(descending=True)[:4]
    keep = (torch.arange(8) < 4 if policy == "position"
            else torch.zeros(8, dtype=torch.bool).index_fill_(0, largest, True))
    assert capped_routing.kept[:, 0].tolist() == keep.tolist()
    torch.testing.assert_close(y[keep], want[keep])
    assert torch.count_nonzero(y[~keep]) == 0


def test_equal_gates_keep_the_earlier_assignment_and_capacities_are_checked():
    moe = MoE(4, 8, num_experts=2, top_k=1, capacity_factor=0.5, drop_policy="probs")
    _all_to_expert_0(moe)
    _, routing = moe(torch.rand(8, 4))  # gates all 1 (softmax over one), capacity 2
    assert routing.kept[:, 0].tolist() == [True, True] + [False] * 6
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(4, 8, num_experts=2, top_k=1, capacity_factor=0.0)
    with pytest.raises(ValueError, match="drop_policy 'random' must be one of"):
        MoE(4, 8, num_experts=2, top_k=1, capacity_factor=1.0, drop_policy="random")


# -- the MoE layer in a block: its losses' gradient, counted once -----------------------------


def _layer(balancing: str, shared: int | None = None, scale: float = 1.0) -> MoELayer:
    torch.manual_seed(0)
    holder = AuxLossScale()
    holder.value = scale
    return MoELayer(16, 24, 6, 2, swiglu=True, scale=holder, balancing=balancing,
                    aux_coeff=0.3, z_coeff=0.05, shared_ffn=shared,
                    init_method_std=0.2).double()


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "none"])
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_the_losses_gradient_is_that_of_adding_them_to_the_loss(balancing, scale):
    """The layer attaches aux_coeff x the balancing loss + z_coeff x the z-loss to its
    output: backward from ``scale`` x (the output's loss) gives every parameter the
    gradient of ``scale`` x (that loss + the routing losses), the shared expert's too."""
    layer = _layer(balancing, shared=8, scale=scale)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randn(3, 5, 16, dtype=torch.float64)
    (scale * (layer(x) - target).square().mean()).backward()
    got = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    for p in [*layer.parameters(), x]:
        p.grad = None
    y, routing = layer.experts(x)
    y = y + layer.shared(x)
    aux = {"aux_loss": switch_aux_loss(routing), "seq_aux_loss": seq_aux_loss(routing, 3),
           "none": 0.0}[balancing]
    loss = (y - target).square().mean() + 0.3 * aux + 0.05 * router_z_loss(routing)
    (scale * loss).backward()
    want = [p.grad for p in layer.parameters()] + [x.grad]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    stats = layer.stats.take()
    assert stats["micro_batches"] == 1 and int(stats["tokens_per_expert"].sum()) == 30
    assert stats["aux"] == pytest.approx(0.0 if balancing == "none" else float(aux.detach()))


def test_the_sequence_loss_is_the_mean_of_each_sequences_switch_loss():
    layer = _layer("seq_aux_loss")
    x = torch.randn(4, 7, 16, dtype=torch.float64)
    routing = layer.experts.router(x.reshape(-1, 16))
    each = []
    for s in range(4):
        rows = slice(7 * s, 7 * s + 7)
        one = layer.experts.router(x[s])
        assert torch.equal(one.experts, routing.experts[rows])
        each.append(switch_aux_loss(one))
    torch.testing.assert_close(seq_aux_loss(routing, 4), torch.stack(each).mean())


def test_evaluation_and_no_grad_attach_and_count_nothing():
    layer = _layer("aux_loss")
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x).sum().backward()
    assert layer.stats.take()["micro_batches"] == 0


def test_group_limited_routing_takes_its_experts_from_the_best_groups():
    """8 experts in 4 groups, top 2 from the best 1 group: every token's two experts are
    one group's, the group whose top 2 logits sum highest; without groups some token's two
    experts lie in two groups (so the limit changed something); the gates are the softmax
    of the chosen logits as ever."""
    torch.manual_seed(0)
    free = Router(16, 8, 2)
    limited = Router(16, 8, 2, groups=(4, 1))
    torch.nn.init.normal_(free.weight)
    limited.weight.data.copy_(free.weight)
    x = torch.randn(64, 16)
    logits = x @ free.weight.t()
    best = logits.view(64, 4, 2).sum(dim=-1).argmax(dim=-1)  # (2 experts a group: both)
    r = limited(x)
    assert torch.equal(r.experts.sort(dim=1).values, torch.stack([2 * best, 2 * best + 1], 1))
    assert torch.allclose(r.gates, torch.softmax(logits.gather(1, r.experts), dim=-1))
    unlimited = free(x).experts
    assert (unlimited[:, 0] // 2 != unlimited[:, 1] // 2).any()


@pytest.mark.peer("megatron.core")
@pytest.mark.parametrize("score,pre_softmax,groups", [
    ("softmax", False, None), ("softmax", False, (4, 2)), ("softmax", True, (4, 2)),
    ("sigmoid", False, None), ("sigmoid", False, (8, 4))])
def test_the_router_routes_as_megatrons(score, pre_softmax, groups):
    """megatron-core 0.16.1's ``topk_routing_with_score_function`` on the same logits
    (16 experts, top 4, the sigmoid's with an expert bias and DeepSeek's scaling): the same
    experts chosen and the same gates, with and without group-limited routing."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    torch.manual_seed(0)
    scaling = 2.5 if score == "sigmoid" else None
    router = Router(32, 16, 4, pre_softmax=pre_softmax, score=score, topk_scaling=scaling,
                    groups=groups)
    torch.nn.init.normal_(router.weight)
    if score == "sigmoid":
        router.expert_bias.normal_(0, 0.1)
    x = torch.randn(128, 32)
    r = router(x)
    probs, chosen = topk_routing_with_score_function(
        x @ router.weight.t(), 4, use_pre_softmax=pre_softmax,
        num_groups=groups[0] if groups else None, group_topk=groups[1] if groups else None,
        scaling_factor=scaling, score_function=score,
        expert_bias=router.expert_bias if score == "sigmoid" else None)
    mine = torch.zeros(128, 16).scatter(1, r.experts, r.gates)
    assert torch.equal(mine != 0, chosen.bool())
    assert torch.allclose(mine, probs, rtol=1e-6, atol=1e-7)


def _global_aux_both(ps, micro_batches: int):
    """(megatron-core's, hybrid's) per-micro-batch global_aux_loss values and router weight
    gradients, 3 micro-batches of one step, then a reset and one micro-batch of the next:
    megatron's TopKRouter on this throwaway process (its CPU patches stay here)."""
    from benchmarks.peers.megatron_side import patch_megatron_for_cpu, patch_megatron_moe_for_cpu
    patch_megatron_for_cpu()
    patch_megatron_moe_for_cpu()  # (its router's unbound te_general_gemm, without TE)
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.moe import GlobalCounts, global_aux_loss
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    e, k, c, coeff = 8, 2, 32, 0.1
    config = TransformerConfig(
        num_layers=1, hidden_size=c, num_attention_heads=4, num_moe_experts=e,
        moe_router_topk=k, moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=coeff, use_cpu_initialization=True, add_bias_linear=False)
    theirs = TopKRouter(config, ProcessGroupCollection.use_mpu_process_groups())
    theirs.set_layer_number(1)
    torch.manual_seed(0)
    torch.nn.init.normal_(theirs.weight, std=0.5)
    mine = Router(c, e, k)
    mine.weight.data.copy_(theirs.weight.data)
    running = GlobalCounts(e, None)
    out = {"theirs": [], "mine": []}
    for m in range(micro_batches + 1):
        if m == micro_batches:  # the next step
            theirs.reset_global_aux_loss_tracker()
            running.reset()
        x = torch.randn(16, 1, c)  # (S, B, C)
        clear_aux_losses_tracker()
        theirs.weight.grad = None
        probs, _ = theirs(x)
        (probs * 0).sum().backward()
        value = get_moe_layer_wise_logging_tracker()["global_load_balancing_loss"]["values"]
        out["theirs"].append((float(value[0]), theirs.weight.grad.clone()))
        mine.weight.grad = None
        loss = global_aux_loss(mine(x.view(-1, c)), running)
        (coeff * loss).backward()
        out["mine"].append((float(loss), mine.weight.grad.clone()))
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.peer("megatron.core")
def test_the_global_aux_loss_is_megatrons():
    """megatron-core 0.16.1's TopKRouter with ``global_aux_loss`` (the expert fractions of
    the step's running mean counts), over 3 micro-batches of a step and the first of the
    next (after its reset): each micro-batch's loss and the router weight's gradient
    equal hybrid's :func:`models.moe.global_aux_loss` within 1e-6."""
    from hybrid.testing.pool import run_ranks
    out = run_ranks(_global_aux_both, 1, args=(3,), reuse=False)[0]
    for (want, want_grad), (got, got_grad) in zip(out["theirs"], out["mine"], strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)
        assert torch.allclose(got_grad, want_grad, rtol=1e-6, atol=1e-9)
    # the running mean moves the value: a step's later micro-batches are not their own
    fresh = [v for v, _ in out["mine"]]
    assert len(set(fresh)) == len(fresh)


def test_the_global_counts_run_over_a_step_and_start_again_at_the_next():
    """``global_aux_loss``'s running counts: each micro-batch's training forward adds its
    counts (an evaluation forward adds none), and the step's end (``MoEWatch.step``, after
    the optimizer) starts them again."""
    from hybrid.config import build_config, parse_args
    from hybrid.parallel.state import ParallelState
    from hybrid.train.moe_stats import MoEWatch
    from hybrid.train.setup import build_model
    cfg = build_config(parse_args(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--num-experts", "4", "--moe-aux-loss-coeff", "0.1",
         "--moe-router-load-balancing-type", "global_aux_loss"]), world_size=1)
    ps = ParallelState.single()
    model = build_model(cfg, ps, 64, None)  # type: ignore[arg-type]  (no dropout)
    layers = model.moe_layers()
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        model(tokens, tokens).backward()
    with torch.no_grad():
        model.eval()
        model(tokens, tokens)
        model.train()
    counts = [layer.global_counts for layer in layers.values()]
    assert [(c.micro_batches, int(c.sum.sum())) for c in counts] == [(2, 2 * 32 * 2)] * 2
    assert cfg.model.moe is not None
    MoEWatch(model, ps, cfg.model.moe).step()
    assert [(c.micro_batches, c.sum) for c in counts] == [(0, None)] * 2


def test_a_split_backward_defers_the_experts_weight_gradients():
    """Under a zero-bubble schedule's input half (``WeightGradStore.deferring``) the
    experts' stacked weights and the shared expert's take no gradient; the weight half
    (``run_deferred``) gives them exactly the plain backward's, and the input gradient
    is the plain one's too."""
    from hybrid.tensor_parallel.weight_grad import WeightGradStore, run_deferred
    torch.manual_seed(0)
    store = WeightGradStore()
    layer = MoELayer(16, 24, 4, 2, swiglu=True, scale=AuxLossScale(), shared_ffn=8,
                     weight_grads=store)
    x = torch.randn(2, 6, 16, requires_grad=True)
    dy = torch.randn(2, 6, 16)
    layer(x).backward(dy)
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    want_x = x.grad.clone()
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with store.deferring() as later:
        layer(x).backward(dy)
    deferred = ("experts.fc", "experts.proj", "shared.fc", "shared.proj")
    assert all(dict(layer.named_parameters())[n].grad is None for n in deferred)
    assert len(later) == 4 and torch.equal(x.grad, want_x)
    pairs = run_deferred(later)
    torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
    for n, p in layer.named_parameters():
        assert torch.equal(p.grad, want[n]), n
