"""AdamW with Megatron's parameter groups, and the true global gradient norm under TP.

[Note: counting TP-replicated parameters once]
After the DP all-reduce every DP replica holds the same gradients, but inside
one replica the TP ranks hold two kinds of parameters: TP shards (disjoint
pieces of a weight, ``param.tp_spec``) and replicated parameters (LayerNorm,
position embeddings, row-parallel biases) whose gradients are identical on
every TP rank. The global squared norm is the sum over TP ranks of the shards'
squares plus the replicated squares *once*: summing everything over TP would
count each replicated parameter TP times.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hybrid.comm import CommGroup
from hybrid.tensor_parallel import is_tp_split


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings); none on biases and norms."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, cfg) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


@torch.no_grad()
def grad_norm(params: list[nn.Parameter], tp_group: CommGroup) -> float:
    """L2 norm of the whole model's gradient (see the note above); all-reduce over TP."""
    device = params[0].device if params else torch.device("cpu")
    split = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if is_tp_split(p):
            split += sq
        else:
            replicated += sq
    tp_group.all_reduce(split)
    return math.sqrt(float(split + replicated))


@torch.no_grad()
def clip_grads(params: list[nn.Parameter], max_norm: float, tp_group: CommGroup) -> float:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before."""
    norm = grad_norm(params, tp_group)
    if max_norm > 0 and norm > max_norm and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
