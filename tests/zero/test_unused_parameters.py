"""Parameters the loss does not reach, as DeepSpeed trains them
(``zero_optimization.ignore_unused_parameters``; hybrid/zero/grad_sync.py, [Note: unused
parameters]).

A tiny model builds a module it never calls (a pooler), a module inside every block it
never calls, and runs one block only in some micro-batches. Through ``hybrid.initialize``
at DP 2, ZeRO stages 0-3, the host and nvme offload tiers, it trains as one process's
``torch.optim.AdamW`` does when every unused parameter's gradient is zero (so AdamW
still decays it); a tied head (one Parameter under two names) gets the sum of its two
uses. With ``ignore_unused_parameters: false`` the first backward is an error naming
the unused parameters.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybrid.errors import TrainingError
from hybrid.parallel.state import ParallelState
from tests.helpers.harness import run_ranks

STEPS, ACCUM, SEQ, VOCAB, H = 3, 2, 8, 32, 16
LR, DECAY = 3e-3, 0.1


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.unused = nn.Linear(H, H)  # built, never called

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class _Net(nn.Module):
    """``blocks`` (stage 3 gathers each as a unit); ``unused`` never runs (RoBERTa's
    pooler under a masked-LM loss); block 1 runs only where ``skip`` is False. ``tied``:
    the head's weight is the embedding's (one Parameter, two names), and block 0 runs
    twice (one module, registered once, used twice in one forward)."""

    def __init__(self, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.tied = tied
        self.embed = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.unused = nn.Linear(H, H)
        self.head = nn.Linear(H, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x, y, skip=False):
        h = self.embed(x)
        for i, b in enumerate(self.blocks):
            if not (skip and i == 1):
                h = b(h)
        if self.tied:
            h = self.blocks[0](h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


def _skips(step, k):
    """Block 1 sits out micro-batch ``k`` of ``step``: the last micro-batch of step 0, the
    first of step 1, ... (by index, so the same on every DP rank)."""
    return (step + k) % 2 == 1


def _batch(step):
    """The global batch of ``step``: (2 DP ranks x ACCUM micro-batches, 1, SEQ + 1) tokens."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2 * ACCUM, 1, SEQ + 1), generator=g)


def _reference(tied):
    """One process, torch AdamW over every parameter, clip 1.0, with a zero gradient for a
    parameter the loss did not reach (torch skips one whose .grad is None; DeepSpeed
    steps it with zeros): micro-batch losses in (step, dp rank, micro) order, the
    parameters at the end."""
    model = _Net(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    losses = []
    for step in range(STEPS):
        batch = _batch(step)
        for i in range(batch.shape[0]):
            t = batch[i]
            loss = model(t[:, :-1], t[:, 1:], _skips(step, i % ACCUM))
            (loss / batch.shape[0]).backward()
            losses.append(float(loss.detach()))
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _ds(stage, **extra):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, **extra},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}}}


def _train(ps, model, backward, step_fn):
    losses = []
    for step in range(STEPS):
        batch = _batch(step)
        for k in range(ACCUM):
            t = batch[ps.dp_rank * ACCUM + k]
            loss = model(t[:, :-1], t[:, 1:], _skips(step, k))
            backward(loss, k)
            step_fn(k)
            losses.append(float(loss.detach()))
    return losses


def _api_run(ps, tied, stage, extra):
    import hybrid
    engine, _, _, _ = hybrid.initialize(model=_Net(tied), config=_ds(stage, **extra),
                                        parallel_state=ps)
    losses = _train(ps, engine, lambda loss, k: engine.backward(loss), lambda k: engine.step())
    engine.zero.wait_optimizer()
    with engine.zero.gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.close()
    return losses, params


def _nvme_run(ps, tied, stage, root):
    """The nvme tier through the ZeRO engine itself: its tiles sized to this model
    (``--offload-buffer-size``, which no ds_config key sets)."""
    from hybrid.config import Flags, build_config
    from hybrid.zero import apply_zero
    cfg = build_config(Flags(zero_stage=stage, offload_optimizer="nvme", offload_nvme_path=root,
                             offload_buffer_size=1024, lr=LR, weight_decay=DECAY,
                             clip_grad=1.0, micro_batch_size=1,
                             global_batch_size=2 * ACCUM), 2)
    model = _Net(tied)
    zero = apply_zero(model, ps, cfg.zero, adamw=cfg.adamw, precision=cfg.precision,
                      offload=cfg.offload, decay="all")
    zero.zero_grad()

    def step(k):
        if k == ACCUM - 1:
            zero.step(LR)
            zero.zero_grad()
    losses = _train(ps, model, lambda loss, k: zero.backward(loss / ACCUM, sync=k == ACCUM - 1),
                    step)
    zero.wait_optimizer()
    with zero.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero.close()
    return losses, params


def _strict_run(ps, stage):
    """``ignore_unused_parameters: false``: the first backward's error."""
    import hybrid
    engine, _, _, _ = hybrid.initialize(
        model=_Net(), config=_ds(stage, ignore_unused_parameters=False), parallel_state=ps)
    t = _batch(0)[ps.dp_rank * ACCUM]
    message = None
    try:
        engine.backward(engine(t[:, :-1], t[:, 1:], True))
    except TrainingError as e:
        message = str(e)
    engine.close()
    return message


def _run(ps, variants, root):
    out = []
    for kind, tied, stage, extra in variants:
        if kind == "api":
            out.append(_api_run(ps, tied, stage, extra))
        elif kind == "nvme":
            out.append(_nvme_run(ps, tied, stage, f"{root}/r{ps.rank}-{len(out)}"))
        else:
            out.append(_strict_run(ps, stage))
    return out


P3 = {"stage3_param_persistence_threshold": 0}
HOST = {"offload_optimizer": {"device": "cpu"}}
SMALL = {"reduce_bucket_size": 300}  # several buckets: the unused ones alone among them
VARIANTS = [("api", False, 0, {}), ("api", False, 1, SMALL), ("api", False, 2, {}),
            ("api", False, 2, {**SMALL, "overlap_comm": True}), ("api", False, 3, P3),
            ("api", False, 1, HOST), ("api", False, 2, {**HOST, **SMALL}),
            ("api", False, 3, {**P3, **HOST}), ("nvme", False, 2, None),
            ("api", True, 0, {}), ("api", True, 2, SMALL), ("api", True, 3, P3),
            ("strict", False, 0, None), ("strict", False, 3, None)]


def test_unused_parameters_train_with_zero_gradients_as_deepspeed(tmp_path):
    """Every stage and offload tier at DP 2, against one process's AdamW whose unused
    parameters get zero gradients: micro-batch losses within 1e-5, parameters within
    the tolerance tests/zero/test_zero.py holds, the unused ones decayed (moved) and
    block 1's trained; the tied model too. Without ignore_unused_parameters the first
    backward names the parameters it did not reach, by their module names."""
    refs = {tied: _reference(tied) for tied in (False, True)}
    res = run_ranks(_run, world_size=2, args=(VARIANTS, str(tmp_path)))
    init = dict(_Net().named_parameters())
    for rank, per_rank in enumerate(res):
        for (kind, tied, stage, extra), got in zip(VARIANTS, per_rank, strict=True):
            what = f"rank {rank}: {kind} tied={tied} stage {stage} {extra}"
            if kind == "strict":
                assert got is not None, what
                named = got.split("]")[0]
                for name in ("'unused.weight'", "'unused.bias'", "'blocks.0.unused.weight'",
                             "'blocks.1.fc.weight'"):
                    assert name in named, (what, got)
                assert "'blocks.0.fc.weight'" not in named and "'embed.weight'" not in named
                assert "zero_optimization.ignore_unused_parameters" in got, got
                continue
            ref_losses, ref_params = refs[tied]
            losses, params = got
            mine = [ref_losses[s * 2 * ACCUM + rank * ACCUM + k]
                    for s in range(STEPS) for k in range(ACCUM)]
            for a, b in zip(losses, mine, strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (what, losses, mine)
            assert set(params) == set(ref_params), what
            for name, want in ref_params.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, what=what, name=name: f"{what}: "
                                                                               f"{name}: {m}")
            if not tied:  # decayed though never used: it moved, as the reference's did
                assert not torch.equal(params["unused.weight"], init["unused.weight"]), what
                assert not torch.equal(params["unused.bias"], init["unused.bias"]), what


def test_one_process_without_ignore_unused_parameters_needs_its_hooks():
    """At DP 1, stage 0, the engine reduces nothing and normally hooks nothing ([Note: no
    hooks when nothing is reduced]); the check needs the hooks, so it keeps them, and
    the default keeps none and trains the unused parameters with zero gradients."""
    from hybrid.config.sections import ZeroConfig
    from hybrid.zero import apply_zero
    ps = ParallelState.single()
    x = torch.randint(0, VOCAB, (1, SEQ))
    loose = apply_zero(model := _Net(), ps, ZeroConfig(stage=0))
    assert not loose.reducer.hooked
    loose.backward(model(x, x))
    assert float(model.unused.weight.grad.abs().sum()) == 0.0
    model = _Net()
    strict = apply_zero(model, ps, ZeroConfig(stage=0, ignore_unused_parameters=False))
    assert strict.reducer.hooked
    with pytest.raises(TrainingError, match=r"parameters \[.*'blocks.0.unused.weight'"):
        strict.backward(model(x, x))


def test_the_ds_config_key_and_the_flag_set_the_option():
    from hybrid.config import Flags, build_config
    from hybrid.config.deepspeed import apply_ds_config
    from hybrid.config.flags import parse_args
    assert build_config(Flags(), 1).zero.ignore_unused_parameters is True
    assert build_config(parse_args(["--no-ignore-unused-parameters"]), 1).zero \
        .ignore_unused_parameters is False
    flags = Flags()
    notes = apply_ds_config(flags, {"zero_optimization": {"ignore_unused_parameters": False}}, 1)
    assert flags.ignore_unused_parameters is False and notes == []
