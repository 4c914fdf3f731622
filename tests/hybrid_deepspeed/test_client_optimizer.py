"""A user's torch optimizer and scheduler through ``deepspeed.initialize(optimizer=...,
lr_scheduler=...)``, stepping the ZeRO shards at DP 2: SGD with momentum and AdamW,
no-decay parameter groups, a frozen layer, a LambdaLR warmup, clipping and gradient
accumulation, at stages 1-3 and with the optimizer offloaded to the host, through
``engine.backward(loss)`` and through a plain ``loss.backward()``. Each run's
micro-batch losses and the rates it applied equal one process stepping the same
optimizer over the whole model (same initialization, the same global batches); a
checkpoint taken midway resumes the run exactly (momentum, moments and the
scheduler's place). ``model_parameters`` groups without a client optimizer run
torch's AdamW of the ds_config's settings over them."""

import torch
from torch import nn

from tests.helpers.harness import run_ranks

ACCUM, MICRO, STEPS = 2, 2, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 6)  # a pretrained part, frozen before initialize
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(torch.tanh(self.frozen(x))))))


def _net():
    torch.manual_seed(0)
    net = Net()
    net.frozen.requires_grad_(False)
    return net


def _groups(net):
    decay = [p for n, p in net.named_parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for n, p in net.named_parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _optimizer(kind, net):
    if kind == "sgd":
        return torch.optim.SGD(_groups(net), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(_groups(net), lr=0.01)


def _warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def _batch(step, rank, k):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    return torch.randn(MICRO, 6, generator=g), torch.randint(0, 3, (MICRO,), generator=g)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _reference(kind, steps, schedule=True):
    """One process: the micro-batch losses in (step, rank, micro) order and each step's
    rates; ``kind`` "sgd", "adamw" (the client optimizers) or "groups" (torch's AdamW of
    the ds_config over the groups, no scheduler)."""
    net = _net()
    opt = (torch.optim.AdamW(_groups(net), lr=0.01) if kind == "groups"
           else _optimizer(kind, net))
    sched = _warmup(opt) if schedule else None
    losses, lrs = [], []
    for step in range(steps):
        for rank in range(2):
            for k in range(ACCUM):
                loss = _loss(net, *_batch(step, rank, k))
                (loss / (2 * ACCUM)).backward()
                losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], 1.0)
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses, lrs


def _config(stage, offload):
    zero = {"stage": stage, "reduce_bucket_size": 64}  # several units, pieces cut at ranks
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": 1.0, "zero_optimization": zero}


def _train(engine, ps, steps, plain=False):
    losses, lrs = [], []
    for step in steps:
        for k in range(ACCUM):
            loss = _loss(engine, *_batch(step, ps.dp_rank, k))
            if k == ACCUM - 1:
                lrs.append(engine.get_lr())
            if plain:  # DeepSpeed 0.18's torch-style backward
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, lrs


def _run(ps, variants, tmp):
    from hybrid import deepspeed
    out = []
    for kind, stage, offload, plain in variants:
        net = _net()
        frozen = net.frozen.weight.detach().clone()
        opt = _optimizer(kind, net)
        engine, optimizer, _, sched = deepspeed.initialize(
            model=net, optimizer=opt, lr_scheduler=_warmup, config=_config(stage, offload),
            mpu=ps)
        first, lrs = _train(engine, ps, range(2), plain)
        path = f"{tmp}/{kind}{stage}{offload}"
        engine.save_checkpoint(path, client_state={"epoch": 1})
        rest, more = _train(engine, ps, range(2, STEPS), plain)
        state = len(optimizer.state)
        # a fresh run resumed from the save
        net2 = _net()
        engine2, *_ = deepspeed.initialize(model=net2, optimizer=_optimizer(kind, net2),
                                           lr_scheduler=_warmup,
                                           config=_config(stage, offload), mpu=ps)
        _, client = engine2.load_checkpoint(path)
        resumed, resumed_lrs = _train(engine2, ps, range(2, STEPS), plain)
        out.append({"losses": first + rest, "lrs": lrs + more, "resumed": resumed,
                    "resumed_lrs": resumed_lrs, "client": client,
                    "frozen_kept": torch.equal(frozen, net.frozen.weight),
                    "state_entries": state, "sched": type(sched).__name__})
        engine.close()
        engine2.close()
    # model_parameters groups, no client optimizer: torch's AdamW of the ds_config
    net = _net()
    cfg = {**_config(2, False), "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, optimizer, _, sched = deepspeed.initialize(model=net, model_parameters=_groups(net),
                                                       config=cfg, mpu=ps)
    losses, _ = _train(engine, ps, range(STEPS))
    out.append({"losses": losses, "sched": type(sched).__name__,
                "groups": [g["weight_decay"] for g in optimizer.param_groups]})
    return out


VARIANTS = [("sgd", 1, False, False), ("adamw", 2, False, True), ("sgd", 3, False, True),
            ("sgd", 2, True, False)]


def test_client_optimizers_and_schedulers_step_the_shards_as_one_process(tmp_path):
    refs = {kind: _reference(kind, STEPS) for kind in ("sgd", "adamw")}
    res = run_ranks(_run, world_size=2, args=(VARIANTS, str(tmp_path)))
    for rank, per_rank in enumerate(res):
        for (kind, stage, offload, plain), got in zip(VARIANTS, per_rank):
            what = (f"rank {rank}: {kind} at stage {stage}{' offloaded' if offload else ''}"
                    f"{' through loss.backward()' if plain else ''}")
            ref_losses, ref_lrs = refs[kind]
            mine = [ref_losses[s * 2 * ACCUM + rank * ACCUM + k]
                    for s in range(STEPS) for k in range(ACCUM)]
            assert len(got["losses"]) == len(mine)
            for a, b in zip(got["losses"], mine):
                assert abs(a - b) <= 1e-5 * abs(b), (what, got["losses"], mine)
            assert got["lrs"] == ref_lrs, what  # the LambdaLR warmup, group by group
            # the resumed run continues exactly: momentum, moments, the warmup's place
            assert got["resumed"] == got["losses"][2 * ACCUM:], what
            assert got["resumed_lrs"] == got["lrs"][2:], what
            assert got["client"] == {"epoch": 1} and got["frozen_kept"], what
            # state for this rank's pieces only, none for the frozen layer
            assert 0 < got["state_entries"] <= 6 and got["sched"] == "LambdaLR", what
        groups = per_rank[-1]
        assert groups["groups"] == [0.1, 0.0] and groups["sched"] == "NoneType"  # as DeepSpeed
        ref, _ = _reference("groups", STEPS, schedule=False)
        mine = [ref[s * 2 * ACCUM + rank * ACCUM + k] for s in range(STEPS) for k in range(ACCUM)]
        for a, b in zip(groups["losses"], mine):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, groups["losses"], mine)
