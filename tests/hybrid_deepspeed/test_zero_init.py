"""``deepspeed.zero.Init`` keeps what a model's constructors write into its parameters, at
2 ranks and ZeRO-3: ``nn.init.normal_(self.scale, std=0.02)`` on a module's own
parameter, a parent's ``self.fc.weight.data.normal_``/``.zero_()``/``.fill_()`` and
``nn.init.normal_``/``trunc_normal_`` on a child already cut, and
``GatheredParameters(..., modifier_rank=0)`` blocks in which rank 0 draws alone. What
the engine holds afterwards is, bit for bit, the model built by one process with the
same seed (the embedding's std 0.02, not nn.Embedding's 1.0), the user's generator goes
on as after that build, and no rank held more than about one module's parameters whole
while building. Ranks that drew from different seeds are refused at initialize."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.harness import run_ranks

D, V, L = 32, 32, 6
DS = {"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.fc.weight.data.normal_(mean=0.0, std=0.02)  # a child's, cut when it returned
        self.fc.bias.data.zero_()
        self.scale = nn.Parameter(torch.empty(D))  # its own, whole until it returns
        nn.init.normal_(self.scale, mean=1.0, std=0.02)


class Net(nn.Module):
    def __init__(self, gathered):
        super().__init__()
        self.embed = nn.Embedding(V, D)  # reset_parameters: std 1.0
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        nn.init.trunc_normal_(self.blocks[0].fc.weight, std=0.02)
        self.blocks[1].fc.bias.data.fill_(0.5)
        self.head = nn.Parameter(torch.empty(V, D))
        with gathered(self.head, modifier_rank=0):  # rank 0 draws alone
            if _rank() == 0:
                nn.init.normal_(self.head, std=0.02)
        with gathered(self.embed.weight, modifier_rank=0), torch.no_grad():
            if _rank() == 0:  # a cut parameter, gathered for the block
                self.embed.weight[0].fill_(1.0 + _rank())
        self.extra = nn.Parameter(torch.randn(7))  # drawn on every rank after that
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)  # in no ZeRO unit

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b.fc(h) * b.scale
        return h @ self.head.t()


def _plain():
    """The model one process builds from seed 0 (rank 0's view: it draws the blocks)."""
    torch.manual_seed(0)
    net = Net(lambda *a, **k: _null())
    return net, torch.rand(4)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _build_under_init(ps):
    from torch.nn.modules import module as torch_module

    from hybrid import deepspeed
    from hybrid.engine.zero_build import held_whole_bytes, is_cut
    seen: list[nn.Parameter] = []
    peak = [0]

    def measure(*_):
        peak[0] = max(peak[0], held_whole_bytes(seen))

    def on_param(module, name, param):
        if param is not None:
            seen.append(param)
        measure()
    hooks = [torch_module.register_module_parameter_registration_hook(on_param),
             torch_module.register_module_module_registration_hook(measure)]
    torch.manual_seed(0)
    try:
        with deepspeed.zero.Init():
            net = Net(deepspeed.zero.GatheredParameters)
    finally:
        for h in hooks:
            h.remove()
    after = torch.rand(4)
    cut = all(is_cut(p) for p in net.parameters())
    engine, *_ = deepspeed.initialize(model=net, config=DS, mpu=ps)
    params = {}
    for n, p in net.named_parameters():
        with deepspeed.zero.GatheredParameters(p):
            params[n] = p.detach().clone()
    engine.close()
    return {"params": params, "after": after, "cut": cut, "peak": peak[0]}


def test_zero_init_keeps_constructor_writes_at_dp2_stage3():
    ref, after = _plain()
    total = sum(p.numel() * 4 for p in ref.parameters())
    block = sum(p.numel() * 4 for p in ref.blocks[0].parameters())
    for rank, got in enumerate(run_ranks(_build_under_init, world_size=2)):
        assert got["cut"], rank
        for n, p in ref.named_parameters():
            assert torch.equal(got["params"][n], p.detach()), (rank, n)
        assert abs(float(got["params"]["embed.weight"][1:].std()) - 0.02) < 0.003
        assert torch.equal(got["params"]["embed.weight"][0], torch.ones(D))  # rank 0's
        assert torch.equal(got["after"], after), rank  # the user's RNG went on alike
        # whole at once while building: the root's head and one parameter brought back
        # at most, about one block -- not the model
        assert got["peak"] <= 2 * block and got["peak"] < total / 3, (got["peak"], block, total)


def _refused(ps):
    from hybrid import deepspeed
    from hybrid.errors import ConfigError
    torch.manual_seed(ps.rank)  # a seed per rank: the parts would not agree
    with deepspeed.zero.Init():
        net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    try:
        deepspeed.initialize(model=net, config=DS, mpu=ps)
    except ConfigError as e:
        return str(e)
    return None


def test_ranks_that_drew_from_different_seeds_are_refused():
    for msg in run_ranks(_refused, world_size=2):
        assert msg is not None and "different random states" in msg, msg


# -- DeepSpeed 0.19.8 on the same patterns (skipped without it) ----------------------------
class Supported(nn.Module):
    """The patterns DeepSpeed's zero.Init keeps too: a module's own parameter initialized
    in its __init__, self.apply(init) (DeepSpeed gathers around it), and a modifier-rank
    block; and a parent's write to a child's parameter, which it loses."""

    def __init__(self, gathered, rank):
        super().__init__()
        self.w = nn.Parameter(torch.empty(V, D))
        nn.init.normal_(self.w, std=0.02)
        self.fc = nn.Linear(D, D)
        self.apply(self._init)
        self.head = nn.Parameter(torch.empty(V, D))
        with gathered(self.head, modifier_rank=0):
            if rank() == 0:
                nn.init.normal_(self.head, std=0.02)
        self.out = nn.Linear(D, D)
        nn.init.zeros_(self.out.weight)  # the parent's write: DeepSpeed loses it

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)


def _gather_all(net, gathered):
    with gathered(list(net.parameters())):
        return {n: p.detach().clone() for n, p in net.named_parameters()}


def _both(ps):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(ps.rank))  # (zero.Init reads it; one host)
    import deepspeed

    import hybrid.deepspeed as hds
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    # (a config without fp16/bf16 keeps fp32: on a CPU its dtype= argument is not read)
    with deepspeed.zero.Init(config_dict_or_path=DS, mem_efficient_linear=False):
        theirs = Supported(deepspeed.zero.GatheredParameters, _rank)
    torch.manual_seed(0)
    with hds.zero.Init():
        ours = Supported(hds.zero.GatheredParameters, _rank)
    return {"theirs": _gather_all(theirs, deepspeed.zero.GatheredParameters),
            "ours": _gather_all(ours, hds.zero.GatheredParameters)}


@pytest.mark.peer("deepspeed")
def test_zero_init_agrees_with_deepspeed_where_deepspeed_keeps_the_writes():
    torch.manual_seed(0)
    plain = Supported(lambda *a, **k: _null(), lambda: 0)
    # throwaway ranks: importing DeepSpeed leaves its patches in a process
    for got in run_ranks(_both, world_size=2, reuse=False):
        for n, p in plain.named_parameters():
            assert torch.equal(got["ours"][n], p.detach()), n
            if n != "out.weight":
                assert torch.equal(got["theirs"][n], p.detach()), n
        # DeepSpeed keeps nn.Linear's own init there; hybrid the parent's zeros
        assert not torch.equal(got["theirs"]["out.weight"], torch.zeros(D, D))


# -- hybrid's own GPT: its init is InitValues' whichever way it is built ------------------
def _gpt(ps, under_zero_init):
    import hybrid
    from hybrid.config import build_config, parse_args
    from hybrid.engine.zero_build import is_cut
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_model
    from tests.helpers.launch import TINY
    cfg = build_config(parse_args(TINY + ["--eval-iters", "0"]), ps.world_size)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    if under_zero_init:
        with hybrid.zero_init():
            model = build_model(cfg, ps, 97, rng)
    else:
        model = build_model(cfg, ps, 97, rng, device="meta")
    cut = all(is_cut(p) for p in model.parameters())
    engine, *_ = hybrid.initialize(model=model, config=DS, parallel_state=ps, seed=cfg.seed)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(2):
        x = torch.randint(0, 97, (1, 33), generator=g)
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.close()
    return cut, losses


def test_hybrids_gpt_built_under_zero_init_trains_as_built_on_meta():
    """Its parameters are cut while it is built, and the engine draws them from the run
    seed (InitValues) as for the meta build pretrain_gpt.py makes: the same losses."""
    on_meta = run_ranks(_gpt, world_size=2, args=(False,))
    for (cut, losses), (_, want) in zip(run_ranks(_gpt, world_size=2, args=(True,)), on_meta):
        assert cut and losses == want, (losses, want)
