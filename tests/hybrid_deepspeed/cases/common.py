"""What the DeepSpeed-style cases share: the registry, two tiny models, seeded batches and
the tutorials' inner loop.

A case is a function ``run(deepspeed, config, workdir) -> Result`` registered with
:func:`case`: a training script as a DeepSpeed user writes one, whose every DeepSpeed
call goes through the module it is handed (``deepspeed`` itself, or
``hybrid.deepspeed``), so the two runs differ in that module only. ``config`` is the
case's ds_config, a fresh copy for each run (engines may read it in place); ``workdir``
is a directory every rank of the run shares, for checkpoints.

A :data:`Result` is JSON: ``losses``, this rank's loss of every micro-batch
(``loss.item()``, in the order trained); ``lrs``, the learning rate each optimizer step
applies, read as scripts read it, ``engine.get_lr()[0]`` before that ``engine.step()``;
and ``extra``, named lists of other numbers a case compares (a norm, a tensor read back
from a checkpoint).

Initial weights are the same under both modules: each case seeds torch
(``torch.manual_seed``) before it builds its model on every rank, and both engines
start every replica from rank 0's values. Data is the same: each rank draws its
batches from a generator seeded by its rank, or takes DistributedSampler's share of
``training_data=``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Result = dict[str, Any]
SEED = 42


@dataclass(frozen=True)
class Case:
    """One script: its name, its ds_config and the function that trains it; ``stages``:
    the pipeline depth its ``PipelineModule`` asks for (1: no pipeline), the layout the
    hybrid run's ranks get."""

    name: str
    config: dict
    run: Callable[[Any, dict, str], Result]
    doc: str = field(default="")
    stages: int = 1

    def __call__(self, deepspeed, workdir: str) -> Result:
        return self.run(deepspeed, copy.deepcopy(self.config), workdir)


CASES: dict[str, Case] = {}


def case(config: dict, stages: int = 1):
    """Register the decorated script under its function's name, with ``config`` (and the
    pipeline depth ``stages`` it builds)."""
    def register(fn):
        assert fn.__name__ not in CASES, fn.__name__
        CASES[fn.__name__] = Case(fn.__name__, config, fn, " ".join((fn.__doc__ or "").split()),
                                  stages)
        return fn
    return register


def ds_config(stage: int = 1, lr: float = 1e-2, weight_decay: float = 0.0, **top) -> dict:
    """A ds_config as the examples write one: fp32, 4 samples per rank and micro-batch,
    torch's AdamW (``torch_adam``: no fused op to build on the CPU) with every
    hyper-parameter spelled out, ZeRO ``stage``; ``top`` adds or replaces top-level keys."""
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 100,
        "optimizer": {"type": "AdamW", "params": {
            "lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": weight_decay,
            "torch_adam": True}},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": stage},
    }
    config.update(top)
    return config


class SimpleModel(nn.Module):
    """The unit tests' kind of model: two linear layers around a LayerNorm (an identity
    when not ``norm``), taking the batch and its labels and returning the loss."""

    def __init__(self, inputs: int = 8, hidden: int = 16, classes: int = 4, norm: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.norm = nn.LayerNorm(hidden) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, classes)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.loss(self.fc2(torch.relu(self.norm(self.fc1(x)))), y)


VOCAB = 32


class TinyBlockLM(nn.Module):
    """The HelloDeepSpeed kind: token and position embeddings, one pre-LN transformer
    block (causal attention, GELU MLP), a head; a dict batch in, the loss out."""

    def __init__(self, hidden: int = 16, heads: int = 2, seq: int = 6):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(),
                                 nn.Linear(2 * hidden, hidden))
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids, labels):
        b, s = input_ids.shape
        x = self.tok(input_ids) + self.pos(torch.arange(s, device=input_ids.device))
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        x = x + self.mlp(self.ln2(x))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def batches(rank: int, n: int, micro: int = 4, inputs: int = 8, classes: int = 4):
    """``n`` micro-batches ``(x, y)`` for ``rank``: seeded by the rank, so the ranks train
    on different data and every run on the same."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(micro, inputs, generator=g),
             torch.randint(0, classes, (micro,), generator=g)) for _ in range(n)]


def token_batches(rank: int, n: int, micro: int = 4, seq: int = 6):
    """``n`` dict batches of token ids and labels for :class:`TinyBlockLM`, by rank."""
    g = torch.Generator().manual_seed(2000 + rank)
    return [{"input_ids": torch.randint(0, VOCAB, (micro, seq), generator=g),
             "labels": torch.randint(0, VOCAB, (micro, seq), generator=g)} for _ in range(n)]


def train(engine, data: Iterable, result: Result | None = None) -> Result:
    """The tutorials' inner loop over ``data`` (``(x, y)`` pairs or dict batches): forward,
    ``engine.backward``, ``engine.step``; the rate each optimizer step applies is read
    before its step. Appends to ``result`` when given (a run in two parts)."""
    result = result if result is not None else {"losses": [], "lrs": [], "extra": {}}
    for batch in data:
        if isinstance(batch, dict):
            loss = engine(**{k: v.to(engine.device) for k, v in batch.items()})
        else:
            x, y = batch
            loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            result["lrs"].append(engine.get_lr()[0])
        engine.step()
        result["losses"].append(loss.item())
    return result
