"""DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``, :mod:`hybrid.deepspeed.moe`).

* Against DeepSpeed 0.19.8's own layer (peer): the same seed, the same input, each gating
  (top-1 with and without random token selection, RSample and Jitter noise, top-2 with
  and without second-expert sampling, top-3, capacity drops, no drops, residual MoE):
  the output, ``l_aux``, the expert counts, every gradient and the RNG state after are
  DeepSpeed's bit for bit (top-3: one rounding, its k weights summed in another order).
* Without DeepSpeed: the gating's arithmetic (capacity, dropped tokens' zero output,
  ``l_aux``), DeepSpeed's optimizer groups, and training through ``deepspeed.initialize``
  at 2 ranks: experts split over EP 2 give the losses and the final weights of EP 1,
  at ZeRO 1 and at ZeRO 3 (which DeepSpeed refuses with MoE), with host offload too,
  including a batch whose tokens all go to one rank's expert (the other's gets none:
  its gradient is zero); a save at EP 2 resumes exactly, and at EP 1 is refused by name.
DeepSpeedExamples' CIFAR script with ``--moe`` against DeepSpeed's recorded losses:
test_deepspeed_examples.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybrid.deepspeed.moe.layer import MoE
from hybrid.deepspeed.moe.utils import (
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)
from tests.helpers.harness import run_ranks

CASES = [dict(num_experts=4, k=1),
         dict(num_experts=4, k=1, noisy_gate_policy="RSample"),
         dict(num_experts=4, k=1, use_rts=False, capacity_factor=0.5),
         dict(num_experts=4, k=1, noisy_gate_policy="Jitter"),
         dict(num_experts=4, k=1, drop_tokens=False),
         dict(num_experts=4, k=1, use_residual=True),
         dict(num_experts=4, k=2),
         dict(num_experts=4, k=2, capacity_factor=0.3),
         dict(num_experts=4, k=2, top2_2nd_expert_sampling=False, drop_tokens=False),
         dict(num_experts=6, k=3, capacity_factor=0.5)]


def _forward_backward(cls, kw: dict):
    torch.manual_seed(0)
    layer = cls(hidden_size=16, expert=nn.Linear(16, 16), min_capacity=0, **kw)
    x = torch.randn(3, 8, 16, requires_grad=True)
    out, l_aux, counts = layer(x)
    (out.square().sum() + l_aux).backward()
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "l_aux": l_aux.detach(), "counts": counts.long(),
            "x.grad": x.grad, "rng": torch.rand(4), **grads}


@pytest.mark.peer("deepspeed")
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_the_layer_is_deepspeed_s(kw):
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    ours, theirs = _forward_backward(MoE, kw), _forward_backward(DeepSpeedMoE, kw)
    assert ours.keys() == theirs.keys()
    bound = 1e-6 if kw["k"] > 2 else 0.0
    for name in theirs:
        assert (ours[name].double() - theirs[name].double()).abs().max() <= bound, name


def test_capacity_drops_tokens_and_l_aux_is_switch_s():
    """Top-1 without random selection, capacity 2 of 8 tokens over 2 experts: each expert
    keeps 2 of its tokens (which: torch.topk's over its 0/1 column, as DeepSpeed), whose
    output is the expert's times the gate, the others' output is 0; ``exp_counts``
    counts before the drop; ``l_aux`` = E * sum(mean gate * fraction routed)."""
    torch.manual_seed(0)
    layer = MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, k=1, min_capacity=0,
                capacity_factor=0.5, use_rts=False)
    x = torch.randn(8, 4)
    out, l_aux, counts = layer(x)
    gates = torch.softmax(x @ layer.deepspeed_moe.gate.wg.weight.t(), dim=1)
    chosen = gates.argmax(dim=1)
    assert counts.tolist() == [int((chosen == e).sum()) for e in (0, 1)]
    assert max(counts.tolist()) > 2  # (some token is dropped)
    frac = torch.stack([(chosen == e).float().mean() for e in (0, 1)])
    assert torch.allclose(l_aux, 2 * (gates.mean(dim=0) * frac).sum())
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    for e in (0, 1):
        mine = (chosen == e).nonzero().flatten().tolist()
        kept = [t for t in mine if out[t].abs().sum() > 0]
        assert len(kept) == min(len(mine), 2), (e, mine, kept)
        for t in kept:
            want = experts[e](x[t]) * gates[t, e]
            assert torch.allclose(out[t], want, atol=1e-6), (e, t)


def test_deepspeed_s_optimizer_groups():
    layer = MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=4, ep_size=2)
    model = nn.Sequential(nn.Linear(4, 4), layer)
    assert has_moe_layers(model) == (True, 4) and has_moe_layers(nn.Linear(2, 2)) == (False, 0)
    experts = [p for p in model.parameters() if is_moe_param(p)]
    assert len(experts) == 4  # 2 local experts' weight and bias
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters", "lr": 0.1})
    assert [(g["name"], g.get("moe", False), len(g["params"]), g["lr"]) for g in groups] == [
        ("parameters", False, 3, 0.1), ("ep_size_2", True, 4, 0.1)]
    # max_group_size cuts the expert group: 20 elements a weight and its bias
    cut = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "parameters"}], max_group_size=20)
    assert [len(g["params"]) for g in cut] == [3, 2, 2]
    with pytest.raises(ValueError, match="without a 'name' key"):
        split_params_into_different_moe_groups_for_optimizer({"params": experts})


def _train(ps, ep: int, stage: int, starve: bool, save: str | None = None,
           load: str | None = None, offload: bool = False):
    """A small net with a DeepSpeed MoE layer of 2 experts trained 3 steps through
    deepspeed.initialize: (each step's loss, the full expert weights after, the last
    step's expert counts). ``save``: a checkpoint there after step 2; ``load``: start
    from the one there, at step 3 (the data drawn as for the first two)."""
    from hybrid import deepspeed
    torch.manual_seed(0)
    layer = MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=ep, k=1,
                min_capacity=0, noisy_gate_policy="RSample")
    if starve:  # every token to expert 0: the argmax of equal gates (no noise) is index 0
        layer.deepspeed_moe.gate.noisy_gate_policy = None
        nn.init.zeros_(layer.deepspeed_moe.gate.wg.weight).requires_grad_(False)
    model = nn.ModuleDict({"inp": nn.Linear(4, 8), "moe": layer, "out": nn.Linear(8, 3)})
    config = {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0}
    if offload:  # the optimizer states and the parameters on the host
        config["zero_optimization"].update(offload_optimizer={"device": "cpu"},
                                           offload_param={"device": "cpu"})
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"})
    engine = deepspeed.initialize(model=model, model_parameters=groups, config=config,
                                  mpu=ps)[0]
    data = torch.Generator().manual_seed(1 + ps.dp_rank)
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for step in range(3):
        x, y = torch.randn(6, 4, generator=data), torch.randint(0, 3, (6,), generator=data)
        if load is not None and step < 2:  # (the checkpoint holds the generator's state)
            continue
        h, _, counts = model["moe"](model["inp"](x))
        loss = nn.functional.cross_entropy(model["out"](torch.relu(h)), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save is not None and step == 1:
            engine.save_checkpoint(save)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    with deepspeed.zero.GatheredParameters(list(experts.parameters())):
        mine = [p.detach().clone() for p in experts.parameters()]
    full = []
    for p in mine:  # every global expert's, in order: EP ranks' local experts
        if ep == 1:
            full.append(p)
            continue
        parts = [torch.empty_like(p) for _ in range(ep)]
        torch.distributed.all_gather(parts, p, group=ps.ep_group.pg)
        full.append(torch.cat(parts))
    return losses, full, counts.tolist()


def _expert_weights(full: list[torch.Tensor], ep: int) -> list[torch.Tensor]:
    """Global expert e's (weight, bias), for e in order."""
    if ep == 1:  # each local expert whole: [w0, b0, w1, b1]
        return full
    w, b = full  # stacked over the EP ranks
    return [w[:8], b[:8], w[8:], b[8:]]


@pytest.mark.parametrize("stage,offload", [(1, False), (3, False), (3, True)])
def test_experts_over_ep_give_ep_1_s_numbers(stage, offload):
    """EP 2 (each rank one expert, tokens by all-to-all) against EP 1 (each rank both):
    the losses of every rank and the final expert weights equal, at ZeRO 1, ZeRO 3, and
    ZeRO 3 with the optimizer and the parameters on the host, up to rounding: an
    expert's gradient is one matmul over both ranks' rows at EP 2, the sum of two ranks'
    matmuls at EP 1."""
    one = run_ranks(_train, world_size=2, args=(1, stage, False, None, None, offload))
    two = run_ranks(_train, world_size=2, ep=2, args=(2, stage, False, None, None, offload))
    for r in (0, 1):
        assert max(abs(a - b) for a, b in zip(one[r][0], two[r][0])) < 1e-6, r
    for a, b in zip(_expert_weights(one[0][1], 1), _expert_weights(two[0][1], 2)):
        assert (a - b).abs().max() < 1e-6
    assert one[0][0][0] != one[0][0][-1]  # (it trained)


def test_an_expert_with_no_tokens_trains_nothing_and_waits_for_no_one():
    """Every token to expert 0 (rank 0's at EP 2): rank 1's expert gets none, its
    weights stay as they started (zero gradient, no decay by default), the run ends."""
    got = run_ranks(_train, world_size=2, ep=2, args=(2, 1, True))
    assert got[0][2] == [6, 0] and got[1][2] == [6, 0]  # each rank's last counts
    torch.manual_seed(0)
    start = nn.Linear(8, 8)  # the expert every copy started from
    w1, b1 = _expert_weights(got[0][1], 2)[2:]
    assert torch.equal(w1, start.weight.detach()) and torch.equal(b1, start.bias.detach())
    w0 = _expert_weights(got[0][1], 2)[0]
    assert not torch.equal(w0, start.weight.detach())


def test_a_checkpoint_at_ep_2_resumes_the_curve(tmp_path):
    """Saved after step 2 at EP 2 x ZeRO 3 (each rank its expert's shard), loaded by a
    fresh engine: step 3's losses equal the uninterrupted run's, to the last bit (the
    checkpoint holds torch's generator, so the gate's noise draws continue too)."""
    whole = run_ranks(_train, world_size=2, ep=2, args=(2, 3, False, str(tmp_path)))
    resumed = run_ranks(_train, world_size=2, ep=2, args=(2, 3, False, None, str(tmp_path)))
    for r in (0, 1):
        assert resumed[r][0] == whole[r][0][2:], r
    for a, b in zip(whole[0][1], resumed[0][1]):
        assert torch.equal(a, b)


def _load_at_ep_1(ps, path: str) -> str:
    try:
        _train(ps, 1, 3, False, None, path)
    except Exception as e:  # noqa: BLE001 -- the error is the result
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_checkpoint_of_deepspeed_s_layer_at_another_ep_size_is_refused(tmp_path):
    """The layer numbers its local experts per EP rank (as DeepSpeed does), so a save at
    EP 2 is another model at EP 1: one error naming the ep_size it was saved at, never
    another rank's experts in place."""
    run_ranks(_train, world_size=2, ep=2, args=(2, 3, False, str(tmp_path)))
    got = run_ranks(_load_at_ep_1, world_size=2, args=(str(tmp_path),))
    for said in got:
        assert said.startswith("CheckpointError: ") and "checkpoint is for a different " \
            "model" in said and "load at the EP size the checkpoint was saved at, 2" in said, said
