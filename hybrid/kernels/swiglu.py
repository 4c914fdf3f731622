"""SwiGLU, the gated MLP activation of Llama (Shazeer 2020).

    y = swiglu(h)     # h (..., 2F) = [gate | up] -> (..., F) = silu(gate) * up

One autograd Function in plain PyTorch ops (no compiled kernel). It saves
only its input ``h`` and recomputes ``silu(gate)`` in backward, as Megatron's
fused bias-SwiGLU does, so the MLP keeps ``h`` (2F) and the down-projection's
input (F) per token: ``3 F`` elements instead of the ``4 F`` of separate
silu and multiply ops. The forward is Hugging Face's ``act_fn(gate) * up``
in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        gate, up = h.chunk(2, dim=-1)
        ctx.save_for_backward(h)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        wide = torch.promote_types(h.dtype, torch.float32)
        gate, up = (t.to(wide) for t in h.chunk(2, dim=-1))
        dyf = dy.to(wide)
        s = torch.sigmoid(gate)
        # d silu(g)/dg = s + g s (1 - s)
        d_gate = dyf * up * s * (1 + gate * (1 - s))
        d_up = dyf * gate * s
        return torch.cat([d_gate, d_up], dim=-1).to(h.dtype)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` along the last dim: (..., 2F) -> (..., F)."""
    return SwiGLUFunction.apply(h)
