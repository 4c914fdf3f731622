"""RMSNorm over the last dimension (Zhang & Sennrich 2019), as Llama uses it.

    y = rms_norm(x, weight, eps)     # x (..., C); weight (C,)

``y = weight * (x / sqrt(mean(x^2) + eps))``, the normalization in fp32 and
cast back to x's dtype before the weight multiplies it: Hugging Face's
``LlamaRMSNorm`` op for op, so an exported model computes the same numbers.

One autograd Function in plain PyTorch ops (no compiled kernel): it saves x
and the fp32 ``1/rms`` per row (``(..., 1)``) and recomputes the normalized x
in backward, so a norm keeps ``x`` plus 4 bytes a row -- what
:mod:`hybrid.estimate.memory` counts -- whatever the intermediate steps.
"""

from __future__ import annotations

import torch


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        n = _wide(x) * rstd  # the normalized x, recomputed
        dyf = _wide(dy)
        dw = (dyf * n).reshape(-1, n.shape[-1]).sum(0)
        dn = dyf * _wide(weight)
        # d/dx of x * rstd(x): rstd * (dn - n * mean(dn * n)) over the last dim
        dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim, scaled by ``weight`` (see the module doc)."""
    return RMSNormFunction.apply(x, weight, eps)
