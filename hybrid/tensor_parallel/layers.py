"""Megatron's tensor-parallel layers.

Shapes below use ``tp`` for the TP group size. Every layer takes the TP
:class:`~hybrid.comm.CommGroup` explicitly; with ``tp == 1`` they are plain
``nn.Linear`` / ``nn.Embedding`` and issue no collective.

Weights are created empty; the model fills them with
:func:`hybrid.tensor_parallel.sharding.init_parameters` so the values do not
depend on the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.comm import CommGroup
from hybrid.tensor_parallel.mappings import (copy_to_tp, gather_from_tp, reduce_from_tp,
                                             scatter_to_tp)
from hybrid.tensor_parallel.sharding import mark_split


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {tp}")
    return n // tp


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by output features (rows) across TP ranks.

    Input ``(..., in_features)``, identical on every TP rank.
    Output ``(..., out_features / tp)`` (this rank's columns of y), or
    ``(..., out_features)`` with ``gather_output=True``.
    Backward all-reduces the input gradient over TP (the f operator).
    ``forward(x, skip_bias_add=True)`` returns ``(y without bias, bias)`` so the
    caller can fuse the bias add into the next op (bias-GELU).
    """

    def __init__(self, in_features: int, out_features: int, tp_group: CommGroup, *,
                 bias: bool = True, gather_output: bool = False, device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group
        self.gather_output = gather_output
        local_out = _divide(out_features, tp_group.size, "out_features")
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(local_out, in_features, **kw))
        mark_split(self.weight, (out_features, in_features), 0, tp_group.rank, tp_group.size)
        if bias:
            self.bias = nn.Parameter(torch.zeros(local_out, **kw))
            mark_split(self.bias, (out_features,), 0, tp_group.rank, tp_group.size)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, skip_bias_add: bool = False):
        x = copy_to_tp(x, self.tp_group)
        if skip_bias_add:
            if self.gather_output:
                raise ValueError("skip_bias_add needs gather_output=False (the bias is local)")
            return F.linear(x, self.weight), self.bias  # (..., out / tp), (out / tp,)
        y = F.linear(x, self.weight, self.bias)  # (..., out / tp)
        return gather_from_tp(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by input features (columns) across TP ranks.

    Input ``(..., in_features / tp)`` when ``input_is_parallel`` (the output of a
    ColumnParallelLinear), else ``(..., in_features)`` which is split here.
    Output ``(..., out_features)``, identical on every TP rank: partial products
    are summed by an all-reduce (the g operator) and the bias, replicated, is
    added once after it.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: CommGroup, *,
                 bias: bool = True, input_is_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        local_in = _divide(in_features, tp_group.size, "in_features")
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, local_in, **kw))
        mark_split(self.weight, (out_features, in_features), 1, tp_group.rank, tp_group.size)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, **kw))  # replicated
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group)
        y = reduce_from_tp(F.linear(x, self.weight), self.tp_group)  # (..., out)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across TP ranks.

    Rank r holds rows ``[r * V / tp, (r + 1) * V / tp)``. Input ids ``(...)``;
    each rank looks up the ids it owns, zeros the rest, and an all-reduce over
    TP assembles ``(..., embedding_dim)`` on every rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: CommGroup, *,
                 device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group
        self.num_embeddings = num_embeddings
        local = _divide(num_embeddings, tp_group.size, "num_embeddings (padded vocab size)")
        self.vocab_start = tp_group.rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        mark_split(self.weight, (num_embeddings, embedding_dim), 0, tp_group.rank, tp_group.size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group)
