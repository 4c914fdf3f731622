"""What a script hands ``initialize`` besides the model: a client optimizer (torch's AdamW,
SGD with momentum), a ``requires_grad`` filter over partly frozen parameters,
Hugging Face's decay / no-decay parameter groups, and a config's weight decay applied
to every parameter it is given."""

from __future__ import annotations

import torch

from tests.hybrid_deepspeed.cases.common import SEED, SimpleModel, batches, case, ds_config, train

STEPS = 4


def _without_optimizer(config: dict) -> dict:
    """The config of a script that builds its own optimizer: no ``optimizer`` block."""
    config = dict(config)
    del config["optimizer"]
    return config


@case(_without_optimizer(ds_config(stage=2)))
def client_adamw(deepspeed, config, workdir):
    """A client ``torch.optim.AdamW`` (lr 0.01, weight decay 0.01 on every parameter) at
    stage 2, no ``optimizer`` block in the config."""
    torch.manual_seed(SEED)
    model = SimpleModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=config)
    return train(engine, batches(engine.global_rank, STEPS))


@case(_without_optimizer(ds_config(stage=1, zero_allow_untested_optimizer=True)))
def client_sgd_momentum(deepspeed, config, workdir):
    """A client ``torch.optim.SGD`` with momentum 0.9 (lr 0.05) at stage 1, which
    DeepSpeed takes with ``zero_allow_untested_optimizer``."""
    torch.manual_seed(SEED)
    model = SimpleModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=config)
    return train(engine, batches(engine.global_rank, STEPS))


@case(ds_config(stage=2))
def frozen(deepspeed, config, workdir):
    """The first layer frozen (``requires_grad_(False)``), the rest handed over through
    the tutorials' ``filter(lambda p: p.requires_grad, ...)``; also the frozen weight's
    sum after training (it must not move)."""
    torch.manual_seed(SEED)
    model = SimpleModel()
    model.fc1.requires_grad_(False)
    parameters = filter(lambda p: p.requires_grad, model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameters,
                                           config=config)
    result = train(engine, batches(engine.global_rank, STEPS))
    result["extra"]["frozen_sum"] = [float(model.fc1.weight.sum()), float(model.fc1.bias.sum())]
    return result


@case(ds_config(stage=2, weight_decay=0.1))
def no_decay_groups(deepspeed, config, workdir):
    """Hugging Face's two groups: weight decay 0.1 on the matrices, 0 on biases and
    LayerNorm weights, passed as ``model_parameters``."""
    torch.manual_seed(SEED)
    model = SimpleModel()
    no_decay = ["bias", "norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return train(engine, batches(engine.global_rank, STEPS))


@case(ds_config(stage=2, weight_decay=0.1))
def weight_decay(deepspeed, config, workdir):
    """The config's AdamW with weight decay 0.1 and ``model.parameters()``: DeepSpeed
    decays every parameter it is given, biases and LayerNorm included."""
    torch.manual_seed(SEED)
    model = SimpleModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return train(engine, batches(engine.global_rank, STEPS))
