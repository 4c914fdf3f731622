"""The one training step (:mod:`hybrid.pipeline.step`) under each door: at PP 1 the trivial
schedule gives the hand-written loop's bits; fp16 scales a loss over 1 the same way
through the Trainer's step, the API engine and DeepSpeed's pipeline engine; the clock and
the meter see a pipeline's actions; DeepSpeed's pipeline engine reads an NVMe-offloaded
optimizer ahead of the step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from hybrid.parallel.state import ParallelState
from hybrid.pipeline.step import TRIVIAL, checked_schedule, micro_batch_loss
from hybrid.tensor_parallel import InitValues
from hybrid.train.activation_meter import SavedActivationMeter
from hybrid.train.phase_clock import PhaseClock
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import (
    _gpt,
    _my_micro_batches,
    _named_params,
    _train_cfg,
    zero_engine,
)


def _replaced_step(model, engine, batches, lr, meter):
    """The PP 1 step as it was written before the executor ran it (its own loop)."""
    engine.zero_grad()
    n, total = len(batches), None
    for i, batch in enumerate(batches):
        with meter if i == 0 else contextlib.nullcontext():
            loss = model(*batch) / n
            engine.backward(loss, sync=(i == n - 1))
        part = loss.detach().float()
        total = part if total is None else total + part
    return total, engine.step(lr, loss=total)


def _built(stage: int, ps: ParallelState, **kw):
    cfg = _train_cfg(1, 1, zero_stage=stage, **kw)
    model = _gpt(cfg, ps, device="meta")
    return cfg, model, zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))


@pytest.mark.parametrize("stage,kw", [(0, {}), (1, {"bf16": True}), (2, {}), (3, {})])
def test_pp1_is_the_trivial_schedule_bit_for_bit(stage, kw):
    """The Trainer's step at PP 1 (the executor running F0 B0 F1 B1 ...) against the loop it
    replaced (forward, ``loss / n``, ``engine.backward``, ``engine.step``): the same losses,
    gradient norms and parameters to the last bit, at ZeRO 0-3; the meter measures the
    first micro-batch as that loop's meter did, and the clock times forward, backward and
    the optimizer only (nothing is sent)."""
    from hybrid.train.step import train_step
    ps = ParallelState.single()
    cfg, model_a, engine_a = _built(stage, ps, **kw)
    _, model_b, engine_b = _built(stage, ps, **kw)
    clock, meter, want_meter = PhaseClock(ps.device), SavedActivationMeter(), SavedActivationMeter()
    for step in range(2):
        batches = _my_micro_batches(step, ps, cfg.loop.micro_batch_size)
        loss_a, result_a, losses = train_step(model_a, engine_a, batches, cfg.lr_schedule.lr,
                                              meter, clock)
        loss_b, result_b = _replaced_step(model_b, engine_b, batches, cfg.lr_schedule.lr,
                                          want_meter)
        assert torch.equal(loss_a, loss_b)
        assert losses.shape == (len(batches),) and float(losses.sum()) == pytest.approx(loss_b)
        assert torch.equal(result_a.grad_norm, result_b.grad_norm)
    a, b = _named_params(model_a, engine_a), _named_params(model_b, engine_b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert meter.peak == want_meter.peak > 0
    assert set(clock.take(2)) == {"forward", "backward", "optimizer"}


def test_the_loss_path_scales_in_fp32_after_the_division():
    """``micro_batch_loss``: ``loss / n``, and that times the scale in fp32, so an fp16 loss
    over 65504 / scale does not overflow; at scale 1 the divided loss itself."""
    loss = torch.tensor(20.0, dtype=torch.float16)
    divided, back = micro_batch_loss(loss, 2, 4096.0)
    assert divided.dtype == torch.float16 and float(divided) == 10.0
    assert back.dtype == torch.float32 and float(back) == 40960.0
    assert float(loss * 4096.0) == float("inf")  # (what fp16 arithmetic would have made)
    same, back = micro_batch_loss(loss, 1, 1.0)
    assert same is loss and back is loss


def _fp16_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


class _Square(nn.Module):
    def forward(self, out, target):
        return ((out - target) ** 2).mean()


def _fp16_doors(ps) -> dict:
    """One fp16 step (loss scale 2**11, two micro-batches whose fp16 losses are near 80:
    halved and times the scale they pass fp16's 65504) through the API engine's backward/step, the
    shared step given that engine, and DeepSpeed's PipelineEngine at one stage: per door,
    (was the step applied, the first layer's weight after it)."""
    from hybrid import deepspeed
    from hybrid.pipeline.step import train_step
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, generator=g)
    y = torch.full((8, 1), 9.0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "fp16": {"enabled": True, "initial_scale_power": 11}}
    batches = [(x[:4].half(), y[:4].half()), (x[4:].half(), y[4:].half())]
    out = {}

    engine, *_ = deepspeed.initialize(model=_fp16_net(0), config=config, parallel_state=ps)
    with torch.no_grad():  # the step's loss; and what fp16 would make of loss / n * scale
        halves = [_Square()(engine.module(xb), yb) / 2 for xb, yb in batches]
        out["loss"] = float(halves[0].float() + halves[1].float())
        out["in_fp16"] = [float(h * 2048.0) for h in halves]
    for xb, yb in batches:
        engine.backward(_Square()(engine(xb), yb))
        engine.step()
    out["api"] = (engine.was_step_applied(), engine.module[0].weight.detach().float().clone())
    engine.close()

    engine, *_ = deepspeed.initialize(model=_fp16_net(0), config=config, parallel_state=ps)
    module = engine.module

    def forward(stage, j, _x):
        return _Square()(module(batches[j][0]), batches[j][1])
    total, result, _ = train_step(forward, checked_schedule(TRIVIAL, 1, 2), engine.zero, 1e-2,
                                  ps.pp_group, shape=(), dtype=torch.float16,
                                  device=ps.device, params={0: list(module.parameters())})
    out["step"] = (not bool(result.skipped), module[0].weight.detach().float().clone())
    out["step_loss"] = float(total)
    engine.close()

    torch.manual_seed(0)
    net = deepspeed.pipe.PipelineModule(layers=[nn.Linear(4, 4), nn.Linear(4, 1)],
                                        loss_fn=_Square(), num_stages=1,
                                        parallel_state=ps)
    engine, *_ = deepspeed.initialize(model=net, config=config, parallel_state=ps)
    out["pipe_loss"] = float(engine.train_batch(iter(batches)))
    layer = next(m for m in engine.module.modules() if isinstance(m, nn.Linear))
    out["pipe"] = (engine.was_step_applied(), layer.weight.detach().float().clone())
    engine.close()
    return out


def test_fp16_scales_a_loss_over_one_the_same_way_through_every_door():
    """fp16 losses near 80 at loss scale 2048 (loss / 2 * scale in fp16 would be inf): the API
    engine, the shared step and DeepSpeed's PipelineEngine each apply the step and leave
    the same weights, bit for bit; the step and the pipeline engine report the true loss
    (not one read back from the scaled value)."""
    out = run_ranks(_fp16_doors, world_size=1)[0]
    assert out.pop("in_fp16") == [float("inf")] * 2
    loss = out.pop("loss")
    assert 60 < loss < 100 and out.pop("step_loss") == out.pop("pipe_loss") == loss
    for door, (applied, _) in out.items():
        assert applied, door
    ref = out["api"][1]
    for door, (_, weight) in out.items():
        assert torch.equal(weight, ref), door


def _pipe_offloaded(ps, root: str) -> dict:
    """DeepSpeed's PipelineEngine at PP 2, ZeRO 1, the optimizer on the cpu tier and on
    NVMe: per tier, the three steps' losses and the tiles read ahead of their steps."""
    import os

    from hybrid import deepspeed
    from tests.hybrid_deepspeed.cases.common import SEED, ds_config
    from tests.hybrid_deepspeed.cases.pipe import CLASSES, WIDTH, _trainset
    out = {}
    for tier in ("cpu", "nvme"):
        torch.manual_seed(SEED)
        net = deepspeed.pipe.PipelineModule(
            layers=[nn.Linear(WIDTH, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                    nn.Linear(16, CLASSES)],
            loss_fn=nn.CrossEntropyLoss(), num_stages=2, parallel_state=ps)
        offload = {"device": tier}
        if tier == "nvme":
            offload["nvme_path"] = os.path.join(root, f"swap{ps.rank}")
        config = ds_config(stage=1, gradient_accumulation_steps=2,
                           zero_optimization={"stage": 1, "offload_optimizer": offload})
        engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                                          training_data=_trainset(), config=config)
        out[tier] = ([float(engine.train_batch()) for _ in range(3)],
                     engine.zero.offload_read_ahead())
        engine.close()
    return out


def test_deepspeeds_pipeline_engine_reads_the_nvme_optimizer_ahead(tmp_path):
    """``train_batch`` is the shared step, so with the optimizer on NVMe each stage starts
    reading its first tiles as soon as its backwards end (``prefetch_step``, which the
    pipeline engine never called before): tiles read ahead in each of the 3 steps, and the
    losses are the cpu tier's to the bit."""
    by_rank = run_ranks(_pipe_offloaded, world_size=2, pp=2, args=(str(tmp_path),))
    for got in by_rank:
        (cpu, none), (nvme, read_ahead) = got["cpu"], got["nvme"]
        assert nvme == cpu
        assert none == 0 and read_ahead >= 3, (none, read_ahead)
