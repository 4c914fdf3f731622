"""All-to-all context parallelism (DeepSpeed-Ulysses): trade the sequence split for a
head split around attention.

Before attention each CP rank holds all heads of its T / C tokens; one
all-to-all over the CP group gives it all T tokens of nh / C heads (K/V: ng / C
heads, so both must divide by C), attention runs on whole sequences, and a
second all-to-all returns the output to the sequence split. Traffic per layer
is four all-to-alls of a T / C block (q, k, v, out), and as many in backward,
independent of C; memory holds the whole sequence for 1 / C of the heads.

The gathered sequence is in rank order (rank 0's tokens, then rank 1's ...);
it is put in position order for causal attention and back after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.context_parallel import segments


def _to_heads(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """``(B, H, T / C, D)`` sequence-split -> ``(B, H / C, T, D)`` head-split, rank order."""
    C = group.size
    B, H, t, D = x.shape
    send = x.reshape(B, C, H // C, t, D).transpose(0, 1).contiguous()  # chunk j: rank j's heads
    recv = torch.empty_like(send)  # chunk j: rank j's tokens of my heads
    group.all_to_all(recv, send)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // C, C * t, D)


def _to_sequence(y: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """The inverse of :func:`_to_heads`."""
    C = group.size
    B, h, T, D = y.shape
    send = y.reshape(B, h, C, T // C, D).permute(2, 0, 1, 3, 4).contiguous()  # chunk j: j's tokens
    recv = torch.empty_like(send)  # chunk j: my tokens of rank j's heads
    group.all_to_all(recv, send)
    return recv.transpose(0, 1).reshape(B, C * h, T // C, D)


class SequenceToHeads(torch.autograd.Function):
    """Forward: all-to-all sequence -> heads over ``group``; backward: heads -> sequence."""

    @staticmethod
    def forward(ctx, x, group: CommGroup):
        ctx.group = group
        return _to_heads(x, group)

    @staticmethod
    def backward(ctx, g):
        return _to_sequence(g, ctx.group), None


class HeadsToSequence(torch.autograd.Function):
    """Forward: all-to-all heads -> sequence over ``group``; backward: sequence -> heads."""

    @staticmethod
    def forward(ctx, y, group: CommGroup):
        ctx.group = group
        return _to_sequence(y, group)

    @staticmethod
    def backward(ctx, g):
        return _to_heads(g, ctx.group), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup,
                      layout: str, attend) -> torch.Tensor:
    """``q`` ``(B, nh, T / C, D)``, ``k``, ``v`` ``(B, ng, T / C, D)`` (this rank's tokens
    in ``layout``) -> ``(B, nh, T / C, D)``. ``attend(q, k, v)`` is causal attention of
    whole sequences in position order, on this rank's nh / C heads."""
    C = group.size
    T = q.shape[2] * C
    pos = torch.cat([s.positions(q.device) for j in range(C)  # made on the device
                     for s in segments(T, C, j, layout)])
    order = torch.argsort(pos)  # rank order -> position order
    q, k, v = (SequenceToHeads.apply(t, group).index_select(2, order) for t in (q, k, v))
    y = attend(q, k, v)  # (B, nh / C, T, D), position order
    return HeadsToSequence.apply(y.index_select(2, pos), group)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention (the fused kernel where torch has one), GQA included."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])
