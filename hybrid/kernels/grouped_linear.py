"""The MoE experts' matrix multiplies: each group of rows times its own weight.

    y = grouped_linear(x, counts, weights)   # x (N, in), rows grouped in order;
                                             # weights[g] (out, in); y (N, out)

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

from hybrid.kernels.linear import linear


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
