"""The MoE experts' matrix multiplies: each group of rows times its own weight.

    y = grouped_linear(x, counts, weights)   # x (N, in), rows grouped in order;
                                             # weights[g] (out, in); y (N, out)
    dx, dw = grouped_linear_grads(dy, x, counts, weights)   # its backward's two halves

Row group ``g`` (``counts[g]`` rows, after the groups before it) times ``weights[g]``
transposed, the groups' outputs in the same order: one linear per group that has rows,
in group order, each by :func:`hybrid.kernels.linear.linear`'s path, so an expert's rows
get exactly the numbers a dense linear of those rows gets (bf16 on a CPU without native
bf16 matrix multiplies runs in fp32 there too). A group with no rows is skipped and its
weight gets no gradient. torch's own grouped matrix multiply is a private, CUDA-only API;
this loop is the path on every device until a kernel here takes its place with the same
contract.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid.kernels.linear import linear, linear_grad_input, linear_grad_weight


def grouped_linear(x: torch.Tensor, counts: Sequence[int],
                   weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``x``'s row groups (``counts``, in order) each times its ``weights[g]`` transposed:
    ``(N, in) -> (N, out)`` (module doc)."""
    if len(counts) != len(weights) or sum(counts) != x.shape[0]:
        raise ValueError(f"{len(counts)} groups of {sum(counts)} rows for {len(weights)} "
                         f"weights and {x.shape[0]} rows")
    parts, start = [], 0
    for w, n in zip(weights, counts):
        if n:
            parts.append(linear(x[start: start + n], w))
        start += n
    if not parts:
        return x.new_empty((0, weights[0].shape[0]))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def grouped_linear_grads(dy: torch.Tensor, x: torch.Tensor, counts: Sequence[int],
                         weights: torch.Tensor, want_input: bool = True
                         ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The backward of :func:`grouped_linear` with ``weights`` stacked ``(G, out, in)``:
    ``(dx (N, in) or None, dW (G, out, in))``, each group's by the linear's own backward
    (:func:`hybrid.kernels.linear.linear_grad_input`, ``linear_grad_weight``); a group
    with no rows gets a zero ``dW``. The two halves are apart so that a zero-bubble
    pipeline can take ``dW`` later (:mod:`hybrid.tensor_parallel.weight_grad`)."""
    dw = torch.zeros_like(weights)
    dx_parts, start = [], 0
    for g, n in enumerate(counts):
        if n:
            rows, grad = x[start: start + n], dy[start: start + n]
            if want_input:
                dx_parts.append(linear_grad_input(grad, weights[g]))
            linear_grad_weight(grad, rows, False, out=dw[g])
        start += n
    if not want_input:
        return None, dw
    dx = torch.cat(dx_parts) if dx_parts else x.new_zeros(x.shape)
    return dx, dw
