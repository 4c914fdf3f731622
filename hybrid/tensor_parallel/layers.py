"""Megatron's tensor-parallel layers.

Shapes below use ``tp`` for the TP group size. Every layer takes the TP
:class:`~hybrid.parallel.comm.CommGroup` explicitly; with ``tp == 1`` they are plain
``nn.Linear`` / ``nn.Embedding`` and issue no collective.

Weights are created empty; the model fills them with
:func:`hybrid.tensor_parallel.init.init_parameters` so the values do not
depend on the layout.

``sequence_parallel=True`` (Korthikanti et al. 2022): activations outside the
TP regions are ``(B, T / tp, C)``, this rank's chunk of the sequence. A
column-parallel layer then all-gathers its input (instead of f), a row-parallel
layer and the embedding reduce-scatter their output (instead of g), and the
replicated parameters used on the local tokens (row-parallel bias, LayerNorm)
get their gradients all-reduced over TP (:func:`sequence_parallel_param`).
The parameters are the same either way, so a checkpoint does not care.

``weight_grads`` (a :class:`~hybrid.tensor_parallel.weight_grad.WeightGradStore`, the
model's one): the column- and row-parallel layers' weight gradients (and the column
layer's bias) can be deferred to it by a split backward's input half; None, the default,
leaves them plain (at TP 1 a plain ``nn.Linear``'s ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.kernels import LayerNorm as _KernelLayerNorm, layer_norm
from hybrid.kernels.rms_norm import rms_norm
from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.column_linear import column_parallel_linear
from hybrid.tensor_parallel.mappings import (
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
    sequence_parallel_param,
)
from hybrid.tensor_parallel.sharding import mark_split
from hybrid.tensor_parallel.weight_grad import WeightGradStore, deferrable_linear


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {tp}")
    return n // tp


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by output features (rows) across TP ranks.

    Input ``(..., in_features)``, identical on every TP rank.
    Output ``(..., out_features / tp)`` (this rank's columns of y), or
    ``(..., out_features)`` with ``gather_output=True``.
    Backward all-reduces the input gradient over TP (the f operator), overlapped
    with the weight gradient (:mod:`hybrid.tensor_parallel.column_linear`).
    ``forward(x, skip_bias_add=True)`` returns ``(y without bias, bias)`` so the
    caller can fuse the bias add into the next op (bias-GELU).
    With ``sequence_parallel`` the input is ``(B, T / tp, in_features)`` and is
    all-gathered along the sequence (backward: all-gathered again for the weight
    gradient, and the input gradient reduce-scattered).

    ``parts > 1`` fuses that many equal linears (SwiGLU's ``[gate; up]``): the
    output features are ``parts`` blocks, each split over TP, and a rank holds
    its rows of every block in order -- ``[gate rows of rank r; up rows of rank
    r]`` -- so its output is ``[its gate | its up]``. The full weight is then the
    ``(parts, out_features / parts, in_features)`` stack of the blocks, split
    along dim 1 (``tp_spec``), which is the same tensor at every TP size: the
    block-seeded init and the checkpoint resharding work on it unchanged.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: CommGroup, *,
                 bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, parts: int = 1,
                 weight_grads: WeightGradStore | None = None, device=None, dtype=None):
        super().__init__()
        if gather_output and parts > 1:
            raise ValueError("gather_output with parts > 1 would interleave the parts")
        self.tp_group = tp_group
        self.weight_grads = weight_grads
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        tp, rank = tp_group.size, tp_group.rank
        per_part = _divide(_divide(out_features, parts, "out_features / parts"), tp,
                           "out_features / parts")
        local_out = parts * per_part
        kw = dict(device=device, dtype=dtype)
        # parts == 1: the plain (out, in) split along dim 0
        lead, dim = ((parts, out_features // parts), 1) if parts > 1 else ((out_features,), 0)
        self.weight = nn.Parameter(torch.empty(local_out, in_features, **kw))
        mark_split(self.weight, (*lead, in_features), dim, rank, tp)
        if bias:
            self.bias = nn.Parameter(torch.zeros(local_out, **kw))
            mark_split(self.bias, lead, dim, rank, tp)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, skip_bias_add: bool = False):
        if skip_bias_add and self.gather_output:
            raise ValueError("skip_bias_add needs gather_output=False (the bias is local)")
        bias = None if skip_bias_add else self.bias
        # (..., out / tp); with SP (B, T / tp, in) -> (B, T, out / tp). Backward overlaps
        # the input gradient's all-reduce (reduce-scatter) with the weight gradient.
        y = column_parallel_linear(x, self.weight, bias, self.tp_group, self.sequence_parallel,
                                   weight_grads=self.weight_grads)
        if skip_bias_add:
            return y, self.bias  # (..., out / tp), (out / tp,)
        return gather_from_tp(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by input features (columns) across TP ranks.

    Input ``(..., in_features / tp)`` when ``input_is_parallel`` (the output of a
    ColumnParallelLinear), else ``(..., in_features)`` which is split here.
    Output ``(..., out_features)``, identical on every TP rank: partial products
    are summed by an all-reduce (the g operator) and the bias, replicated, is
    added once after it. With ``sequence_parallel`` the sum is reduce-scattered
    along the sequence instead: output ``(B, T / tp, out_features)``.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: CommGroup, *,
                 bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, weight_grads: WeightGradStore | None = None,
                 device=None, dtype=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.tp_group = tp_group
        self.weight_grads = weight_grads
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
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
        # (its bias is added outside the matmul: its gradient comes with the input's)
        xw = deferrable_linear(x, self.weight, self.weight_grads)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(xw, self.tp_group)
            bias = (None if self.bias is None
                    else sequence_parallel_param(self.bias, self.tp_group))
        else:
            # the matmul's fresh output: reduced in place (mappings.py, in-place note)
            y = reduce_from_tp(xw, self.tp_group, inplace=True)  # (..., out)
            bias = self.bias
        return y + bias if bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across TP ranks.

    Rank r holds rows ``[r * V / tp, (r + 1) * V / tp)``. Input ids ``(...)``;
    each rank looks up the ids it owns, zeros the rest, and an all-reduce over
    TP assembles ``(..., embedding_dim)`` on every rank -- or, with
    ``sequence_parallel``, a reduce-scatter leaves each rank its sequence chunk
    ``(B, T / tp, embedding_dim)`` of ids ``(B, T)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: CommGroup, *,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
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
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp_group)
        return reduce_from_tp(out, self.tp_group, inplace=True)  # masked_fill saved only the mask


class LayerNorm(_KernelLayerNorm):
    """LayerNorm over the last dim (``hybrid.kernels``' op), replicated over TP.

    With ``sequence_parallel`` it normalizes this rank's tokens only, so its
    weight and bias enter through :func:`sequence_parallel_param`: their
    gradients are all-reduced over ``tp_group`` and every replica stays equal.
    """

    def __init__(self, hidden_size: int, tp_group: CommGroup, *, eps: float = 1e-5,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_group.size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: torch.Tensor = self.weight
        b: torch.Tensor = self.bias
        if self.sequence_parallel:
            w, b = sequence_parallel_param(w, self.tp_group), sequence_parallel_param(
                b, self.tp_group)
        return layer_norm(x, w, b, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (:func:`hybrid.kernels.rms_norm.rms_norm`), replicated
    over TP: one weight ``(C,)``, no bias.

    With ``sequence_parallel`` it normalizes this rank's tokens only, so like
    :class:`LayerNorm` its weight enters through :func:`sequence_parallel_param`:
    the gradient is all-reduced over ``tp_group`` and the replicas stay equal.
    """

    def __init__(self, hidden_size: int, tp_group: CommGroup, *, eps: float = 1e-5,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp_group.size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: torch.Tensor = self.weight
        if self.sequence_parallel:
            w = sequence_parallel_param(w, self.tp_group)
        return rms_norm(x, w, self.eps)
