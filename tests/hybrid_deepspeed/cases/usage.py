"""How a script drives the engine beyond the basic loop: ``training_data=`` and the
loader ``initialize`` returns, a plain ``loss.backward()``, a checkpoint saved under a
string tag with a tensor in ``client_state`` and resumed into a fresh engine, and a
model built under ``zero.Init`` whose constructor draws its own weights."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.hybrid_deepspeed.cases.common import (
    SEED,
    Result,
    SimpleModel,
    batches,
    case,
    ds_config,
    train,
)

STEPS = 4


@case(ds_config(stage=1))
def training_data(deepspeed, config, workdir):
    """``training_data=`` a dataset of 28 samples: the returned loader gives each rank 14
    (DistributedSampler; micro-batches of 4, 4, 4, 2), trained for two epochs."""
    torch.manual_seed(SEED)
    model = SimpleModel()
    g = torch.Generator().manual_seed(7)
    trainset = TensorDataset(torch.randn(28, 8, generator=g),
                             torch.randint(0, 4, (28,), generator=g))
    engine, _, trainloader, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=trainset, config=config)
    result: Result = {"losses": [], "lrs": [], "extra": {"batch_sizes": []}}
    for _epoch in range(2):
        for inputs, labels in trainloader:
            result["extra"]["batch_sizes"].append(len(inputs))
            train(engine, [(inputs, labels)], result)
    return result


@case(ds_config(stage=2, gradient_accumulation_steps=2))
def loss_backward(deepspeed, config, workdir):
    """A plain ``loss.backward()`` instead of ``engine.backward(loss)``, then
    ``engine.step()``, accumulating 2 micro-batches a step (the engine divides the
    gradients by 2 itself)."""
    torch.manual_seed(SEED)
    model = SimpleModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    losses, lrs = [], []
    for x, y in batches(engine.global_rank, 2 * STEPS):
        loss = engine(x.to(engine.device), y.to(engine.device))
        loss.backward()
        if engine.is_gradient_accumulation_boundary():
            lrs.append(engine.get_lr()[0])
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "lrs": lrs, "extra": {}}


@case(ds_config(stage=2, scheduler={"type": "WarmupCosineLR", "params": {
    "total_num_steps": 6, "warmup_num_steps": 2}}))
def checkpoint_tag(deepspeed, config, workdir):
    """Three steps, ``save_checkpoint(dir, tag="epoch1", client_state=...)`` holding a
    tensor (rank 0's mean loss) beside a number, three more steps; then a fresh engine
    (another seed's weights) loads tag "epoch1" and trains the same last three. The
    losses and rates of both are compared, and what ``client_state`` brought back."""
    torch.manual_seed(SEED)
    model = SimpleModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    data = batches(engine.global_rank, 6)
    result = train(engine, data[:3])
    client_state = {"epoch": 1, "mean_loss": torch.tensor([sum(result["losses"]) / 3])}
    engine.save_checkpoint(workdir, tag="epoch1", client_state=client_state)
    train(engine, data[3:], result)

    torch.manual_seed(SEED + 1)
    fresh_model = SimpleModel()
    fresh, _, _, _ = deepspeed.initialize(model=fresh_model,
                                          model_parameters=fresh_model.parameters(),
                                          config=config)
    _, loaded = fresh.load_checkpoint(workdir, tag="epoch1")
    resumed = train(fresh, data[3:])
    result["extra"] = {"resumed_losses": resumed["losses"], "resumed_lrs": resumed["lrs"],
                       "client_epoch": [loaded["epoch"]],
                       "client_mean_loss": loaded["mean_loss"].tolist()}
    return result


class ConstructorInit(SimpleModel):
    """SimpleModel whose constructor draws its linear layers' weights itself (normal,
    std 0.3; zero biases), as GPT-style models do, inside
    ``zero.GatheredParameters(..., modifier_rank=0)``: DeepSpeed's way to write into
    parameters ``zero.Init`` has already partitioned."""

    def __init__(self, deepspeed):
        super().__init__()
        for linear in (self.fc1, self.fc2):
            with deepspeed.zero.GatheredParameters([linear.weight, linear.bias], modifier_rank=0):
                nn.init.normal_(linear.weight, std=0.3)
                nn.init.zeros_(linear.bias)


@case(ds_config(stage=3, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}))
def zero_init_constructor(deepspeed, config, workdir):
    """The model built under ``zero.Init(config_dict_or_path=config)`` with its
    constructor's own init, then stage 3; the first loss already shows whether the
    constructor's weights were kept."""
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = ConstructorInit(deepspeed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return train(engine, batches(engine.global_rank, STEPS))


def _two_backwards(deepspeed, config, workdir):
    torch.manual_seed(SEED)
    model = SimpleModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    losses, lrs = [], []
    data = batches(engine.global_rank, 2 * STEPS)
    for (x1, y1), (x2, y2) in zip(data[::2], data[1::2]):
        first = engine(x1.to(engine.device), y1.to(engine.device))
        engine.backward(first)
        second = engine(x2.to(engine.device), y2.to(engine.device))
        engine.backward(second)
        lrs.append(engine.get_lr()[0])
        engine.step()
        losses += [first.item(), second.item()]
    return {"losses": losses, "lrs": lrs, "extra": {}}


# DeepSpeedExamples' GAN: two engine.backward calls, then one engine.step(), every step
for _stage in (0, 1, 2, 3):
    def _script(deepspeed, config, workdir):
        return _two_backwards(deepspeed, config, workdir)
    _script.__name__ = f"two_backwards_stage{_stage}"
    _script.__doc__ = (f"ZeRO stage {_stage}: two engine.backward calls, each of its own "
                       f"micro-batch's loss, then one engine.step() (DeepSpeedExamples' GAN "
                       f"trains its discriminator so): the step applies both gradients.")
    case(ds_config(stage=_stage))(_script)
