"""LayerNorm over the last dimension: fused CUDA kernel, eager, or torch.compile.

    y = layer_norm(x, weight, bias, eps)     # x (..., C); weight, bias (C,)

The path comes from :func:`hybrid.kernels.select.kernel_choice`; every path
computes ``F.layer_norm(x, (C,), weight, bias, eps)``. The kernel needs weight
and bias of x's dtype (fp32/bf16/fp16, as in a bf16 model) and accumulates in
fp32; anything else (no affine, mixed dtypes, autocast) takes the eager path.
:class:`LayerNorm` is ``nn.LayerNorm`` with that forward: same parameters and
state-dict names, so checkpoints and the HF export do not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.kernels.select import compiled, kernel_choice

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedLayerNormFunction(torch.autograd.Function):
    """Kernel path. Saves x, weight and the fp32 (mean, rstd) per row."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        from hybrid.kernels.cuda_ops import cuda_ops
        ops = cuda_ops()
        x = x.contiguous()
        weight, bias = weight.contiguous(), bias.contiguous()
        y, mean, rstd = ops.layer_norm_fwd(x, weight, bias, float(eps))
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        from hybrid.kernels.cuda_ops import cuda_ops
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = cuda_ops().layer_norm_bwd(dy.contiguous(), x, weight, mean, rstd)
        return dx, dw, db, None


def layer_norm_eager(x, weight, bias, eps: float):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _fusable(x, weight, bias) -> bool:
    return (weight is not None and bias is not None and x.dtype in _DTYPES
            and weight.dtype == x.dtype and bias.dtype == x.dtype
            and weight.dim() == 1 and weight.numel() == x.shape[-1])


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` over the last dim of ``x``, by the selected path."""
    path = kernel_choice("layer_norm", x.device)
    if path == "fused" and _fusable(x, weight, bias):
        return FusedLayerNormFunction.apply(x, weight, bias, eps)
    if path == "compile":
        return compiled(layer_norm_eager)(x, weight, bias, eps)
    return layer_norm_eager(x, weight, bias, eps)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose forward goes through :func:`layer_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)
        return layer_norm(x, self.weight, self.bias, self.eps)
