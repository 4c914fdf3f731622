"""The ZeRO stages, host offload, gradient accumulation and clipping: each a ds_config
switch on the same script (a model built under a seed, ``deepspeed.initialize`` with
``model.parameters()``, the inner loop over rank-seeded batches); and that script on a
model with parameters its loss does not reach (HelloDeepSpeed's never-called pooler)."""

from __future__ import annotations

import os

import torch
from torch import nn

from tests.hybrid_deepspeed.cases.common import (
    SEED,
    Result,
    SimpleModel,
    TinyBlockLM,
    batches,
    case,
    ds_config,
    token_batches,
    train,
)

STEPS = 4


def _simple(deepspeed, config, micro_batches=STEPS):
    torch.manual_seed(SEED)
    model = SimpleModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return train(engine, batches(engine.global_rank, micro_batches))


@case(ds_config(stage=1))
def zero1(deepspeed, config, workdir):
    """ZeRO stage 1: the optimizer state partitioned over DP, four steps."""
    return _simple(deepspeed, config)


@case(ds_config(stage=2))
def zero2(deepspeed, config, workdir):
    """ZeRO stage 2: gradients and optimizer state partitioned, four steps."""
    return _simple(deepspeed, config)


@case(ds_config(stage=3, zero_optimization={"stage": 3,
                                            "stage3_param_persistence_threshold": 0}))
def zero3(deepspeed, config, workdir):
    """ZeRO stage 3 on a tiny transformer block (dict batches of token ids), every
    parameter partitioned (no persistence threshold), four steps."""
    torch.manual_seed(SEED)
    model = TinyBlockLM()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return train(engine, token_batches(engine.global_rank, STEPS))


@case(ds_config(stage=2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}))
def offload_optimizer(deepspeed, config, workdir):
    """ZeRO-Offload: stage 2 with the optimizer state and step on the host."""
    return _simple(deepspeed, config)


@case(ds_config(stage=3, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0,
                                            "offload_optimizer": {"device": "cpu"},
                                            "offload_param": {"device": "cpu"}}))
def offload_param(deepspeed, config, workdir):
    """ZeRO-Infinity on the host: stage 3 with parameters and optimizer offloaded to the
    CPU, the transformer block."""
    torch.manual_seed(SEED)
    model = TinyBlockLM()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return train(engine, token_batches(engine.global_rank, STEPS))


@case(ds_config(stage=2, gradient_accumulation_steps=2))
def accumulation(deepspeed, config, workdir):
    """Gradient accumulation over 2 micro-batches at stage 2: eight micro-batches, four
    optimizer steps (a rate read at each boundary)."""
    return _simple(deepspeed, config, micro_batches=2 * STEPS)


@case(ds_config(stage=2, gradient_clipping=1.0))
def clipping(deepspeed, config, workdir):
    """Gradient clipping at norm 1.0 at stage 2, on the model without its LayerNorm and
    the first batch's inputs 20 times larger (a spike): Adam is blind to a scale common
    to every step, so only a clip that cuts one step's gradients far more than the
    next's shows in the losses. Also the global norm each step saw
    (``get_global_grad_norm()``, before clipping)."""
    torch.manual_seed(SEED)
    model = SimpleModel(norm=False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    result: Result = {"losses": [], "lrs": [], "extra": {"grad_norm": []}}
    for i, (x, y) in enumerate(batches(engine.global_rank, STEPS)):
        train(engine, [(x * 20 if i == 0 else x, y)], result)
        result["extra"]["grad_norm"].append(float(engine.get_global_grad_norm()))
    return result


class _UnusedLM(TinyBlockLM):
    """HelloDeepSpeed's shape: the block LM with a pooler it builds and never calls
    (``RobertaModel``'s default, under a masked-LM loss) and its attention never run
    either, an extra layer only every other micro-batch runs, and the head tied to the
    token embedding (one Parameter, two names)."""

    def __init__(self):
        super().__init__()
        hidden = self.tok.weight.shape[1]
        self.pooler = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.sometimes = nn.Linear(hidden, hidden)
        self.head.weight = self.tok.weight
        self.calls = 0

    def forward(self, input_ids, labels):
        self.calls += 1
        s = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(s, device=input_ids.device))
        x = x + self.mlp(self.ln2(x))
        if self.calls % 2 == 0:  # (by the micro-batch's index: alike on every rank)
            x = x + torch.tanh(self.sometimes(x))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _unused_parameters(deepspeed, config, workdir, norms: bool = True):
    torch.manual_seed(SEED)
    model = _UnusedLM()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    result: Result = {"losses": [], "lrs": [], "extra": {"grad_norm": []}}
    for batch in token_batches(engine.global_rank, 2 * STEPS):
        train(engine, [batch], result)
        if norms and len(result["losses"]) % 2 == 0:  # (an accumulation boundary's step)
            result["extra"]["grad_norm"].append(float(engine.get_global_grad_norm()))
    named = dict(model.named_parameters())
    result["extra"]["weights"] = [float(named["pooler.0.weight"].sum()),
                                  float(named["sometimes.weight"].sum()),
                                  float(named["qkv.weight"].sum())]
    return result


# Unused and tied parameters at every ZeRO stage and with the optimizer (and at stage 3
# the parameters) on the host: one script, six configs
_UNUSED_ZERO = {
    "unused_parameters": {"stage": 2},
    "unused_parameters_stage0": {"stage": 0},
    "unused_parameters_stage1": {"stage": 1},
    "unused_parameters_stage3": {"stage": 3},
    "unused_parameters_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "unused_parameters_offload_param": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                        "offload_param": {"device": "cpu"}},
    # (the swap files under the case's own directory: the script sets nvme_path; buffers
    # of 64 KiB, DeepSpeed's default 100M-element ones being 2 GB of host memory here)
    "unused_parameters_nvme": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                               "offload_param": {"device": "nvme", "buffer_size": 16384}},
}


def _swap_files_in(config: dict, workdir: str) -> None:
    """Each nvme tier of ``config`` swaps under ``workdir/nvme`` (a case's config is written
    before its directory exists)."""
    for tier in ("offload_optimizer", "offload_param"):
        section = config["zero_optimization"].get(tier, {})
        if section.get("device") == "nvme":
            section["nvme_path"] = os.path.join(workdir, "nvme")


def _unused_case(name: str, zero: dict):
    def script(deepspeed, config, workdir):
        _swap_files_in(config, workdir)
        # (DeepSpeed's fp32 engine at stage 0 clips without keeping the norm: it reports None)
        return _unused_parameters(deepspeed, config, workdir, norms=zero["stage"] > 0)
    script.__name__ = name
    where = ", ".join(f"{k} {v}" for k, v in zero.items())
    script.__doc__ = (
        f"ZeRO {where} with parameters the loss does not reach (``ignore_unused_parameters``, "
        f"true by default): a pooler never called, an attention never run, a layer only every "
        f"other micro-batch runs (the second of each accumulation window), a head tied to the "
        f"embedding; weight decay 0.1, so the unused parameters still move. Also each step's "
        f"global norm and, at the end, the sums of the pooler's and the sometimes-layer's "
        f"weights.")
    case(ds_config(stage=zero["stage"], weight_decay=0.1, gradient_accumulation_steps=2,
                   zero_optimization=zero))(script)


for _name, _zero in _UNUSED_ZERO.items():
    _unused_case(_name, _zero)
