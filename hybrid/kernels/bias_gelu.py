"""``gelu(x + bias)`` for the GPT MLP: fused CUDA kernel, eager, or torch.compile.

    y = bias_gelu(x, bias, approximate)   # x (..., F) without its bias, bias (F,), same dtype

Every path computes ``F.gelu(x + bias, approximate=approximate)`` ("none": the exact
GELU, "tanh": GPT-2's, ``--openai-gelu``). The kernel saves x and bias for
backward (the same memory as eager's saved ``x + bias`` plus the small bias),
recomputes the sum, and returns dbias as the column sum of dx.

:func:`splits_bias` says whether the caller should keep the bias out of the
matmul: only for a non-eager path. On the eager path (always on CPU) the MLP
keeps ``F.linear(x, W, b)`` so its numerics stay exactly what they were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.kernels.select import compiled, kernel_choice

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedBiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tanh: bool):
        from hybrid.kernels.cuda_ops import cuda_ops
        x, bias = x.contiguous(), bias.contiguous()
        ctx.save_for_backward(x, bias)
        ctx.tanh = tanh
        return cuda_ops().bias_gelu_fwd(x, bias, tanh)

    @staticmethod
    def backward(ctx, dy):
        from hybrid.kernels.cuda_ops import cuda_ops
        x, bias = ctx.saved_tensors
        dx, dbias = cuda_ops().bias_gelu_bwd(dy.contiguous(), x, bias, ctx.tanh)
        return dx, dbias, None


def bias_gelu_eager(x, bias, approximate: str):
    return F.gelu(x + bias, approximate=approximate)


def splits_bias(x: torch.Tensor) -> bool:
    """True when bias_gelu on ``x``'s device takes a fused or compiled path."""
    return kernel_choice("bias_gelu", x.device) != "eager"


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)`` by the selected path."""
    path = kernel_choice("bias_gelu", x.device)
    if (path == "fused" and x.dtype in _DTYPES and bias.dtype == x.dtype and bias.dim() == 1
            and bias.numel() == x.shape[-1]):
        return FusedBiasGeluFunction.apply(x, bias, approximate == "tanh")
    if path == "compile":
        return compiled(bias_gelu_eager)(x, bias, approximate)
    return bias_gelu_eager(x, bias, approximate)
