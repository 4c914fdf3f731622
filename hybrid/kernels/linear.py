"""``y = x W^T + b`` for the TP layers: torch's own, or computed in fp32 for a CPU
without native bf16/fp16 matrix multiplies.

    y = linear(x, weight, bias)      # x (..., in), weight (out, in), bias (out,) or None
    g = matmul(a, b)                 # a (..., n, k) @ b (k, m), for hand-written backwards

Path ``"eager"`` is ``F.linear`` / ``torch.matmul``. Path ``"fp32"`` (chosen by
:func:`hybrid.kernels.select.kernel_choice`, on the CPU only) upcasts the operands,
multiplies in fp32 and rounds the result to the input's dtype: what a native
bf16 GEMM computes (fp32 products of bf16 values are exact, sums accumulate in
fp32, one rounding at the end), up to the order of the sums. Its backward does
the same for ``dx = dy W`` and ``dW = dy^T x``. It saves ``x`` and ``weight``
themselves for backward -- what ``F.linear`` saves -- so activation memory is
unchanged; the fp32 copies live only inside one forward or backward call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.kernels.select import kernel_choice


class _Fp32Linear(torch.autograd.Function):
    """forward: ``F.linear`` on fp32 copies, rounded to ``x.dtype``.
    backward: ``dx = dy W``, ``dW = dy^T x``, ``db = sum dy``, each in fp32 and rounded."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = linear_grad_input(dy, weight) if ctx.needs_input_grad[0] else None
        dw, db = linear_grad_weight(dy, x, ctx.has_bias and ctx.needs_input_grad[2])
        return dx, (dw if ctx.needs_input_grad[1] else None), db


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the selected path (see the module doc)."""
    if kernel_choice("linear", x.device, x.dtype) == "fp32" and weight.dtype == x.dtype:
        return _Fp32Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_grad_input(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dx = dy W`` of :func:`linear`, by its path: ``(..., out) -> (..., in)``, the
    same bits autograd would give (a fresh tensor)."""
    return matmul(dy, weight)


def linear_grad_weight(dy: torch.Tensor, x: torch.Tensor, bias: bool,
                       out: torch.Tensor | None = None):
    """``(dW = dy^T x, db = sum dy or None)`` of :func:`linear`, by its path, over the
    flattened rows of ``dy (..., out)`` and ``x (..., in)``. ``out``: a contiguous
    ``(out, in)`` tensor to write ``dW`` into (a view of a larger gradient)."""
    if kernel_choice("linear", x.device, x.dtype) == "fp32" and dy.dtype == x.dtype:
        d2 = dy.float().flatten(0, -2)  # (rows, out); flatten: out may be 0
        dw = d2.t().matmul(x.flatten(0, -2).float())
        dw = dw.to(x.dtype) if out is None else out.copy_(dw)
        return dw, (d2.sum(0).to(x.dtype) if bias else None)
    d2 = dy.flatten(0, -2)
    dw = torch.matmul(d2.t(), x.flatten(0, -2), out=out)
    return dw, (d2.sum(0) if bias else None)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` by the selected path: in fp32 and rounded to ``a.dtype``
    where :func:`linear` would be. Not differentiable on that path (for backwards)."""
    if kernel_choice("linear", a.device, a.dtype) == "fp32" and b.dtype == a.dtype:
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)
