"""Context parallelism: one sequence split over the CP group, attention across the split.

[Note: which tokens a CP rank holds]
Causal attention's work grows along the sequence (token i attends to i + 1
keys), so equal contiguous slices would give the last rank the most work.
Two layouts even it out, both as a list of global positions per rank
(:func:`cp_positions`):

* ``load_balanced`` (Megatron's): the sequence is cut into 2C chunks and rank
  r holds chunks r and 2C - 1 - r -- an early and a late chunk, whose causal
  work sums to the same for every rank (exactly: :func:`causal_pairs`);
* ``striped`` (Striped Attention): token i to rank i mod C.

Everything that depends on a token's position (RoPE, the causal mask, the
loss mask) reads these global positions, never the local index.

[Note: all-gather attention]
The simplest exchange: each rank all-gathers K and V of the whole sequence
over CP once per layer (:class:`_GatherSequence`: its backward reduce-scatters
dK and dV to their owners), then attends its own queries to every key with
the causal mask taken from global positions. Exact, and fine at small C; K/V
memory per rank is the whole sequence's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.parallel.comm import CommGroup

LAYOUTS = ("load_balanced", "striped")


def cp_positions(seq_len: int, cp_size: int, cp_rank: int,
                 layout: str = "load_balanced") -> torch.Tensor:
    """Global positions (``(seq_len / cp_size,)`` int64, ascending) of ``cp_rank``'s
    tokens. ``seq_len`` must be a multiple of 2 x cp_size (load_balanced) or cp_size."""
    if layout not in LAYOUTS:
        raise ValueError(f"context-parallel layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "striped":
        if seq_len % cp_size:
            raise ValueError(f"sequence length {seq_len} is not a multiple of the "
                             f"context-parallel size {cp_size}")
        return torch.arange(cp_rank, seq_len, cp_size)
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x the "
                         f"context-parallel size {cp_size} (the load-balanced layout cuts it "
                         f"into {chunks} chunks)")
    c = seq_len // chunks
    first, last = cp_rank, chunks - 1 - cp_rank
    return torch.cat([torch.arange(first * c, (first + 1) * c),
                      torch.arange(last * c, (last + 1) * c)])


def cp_shard(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int,
             layout: str = "load_balanced") -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` (a full sequence), in position order."""
    pos = cp_positions(x.shape[dim], cp_size, cp_rank, layout).to(x.device)
    return x.index_select(dim, pos)


def causal_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """(query, key) pairs the causal mask keeps: the attention work of these queries."""
    return int((q_pos[:, None] >= k_pos[None, :]).sum())


class _GatherSequence(torch.autograd.Function):
    """``(B, H, T / C, D)`` -> ``(B, H, T, D)`` in rank order over ``group``; backward
    sums the gradient over the group and keeps this rank's part (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        n = group.size
        parts = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        group.all_gather(parts, x.contiguous())
        return torch.cat(list(parts.unbind(0)), dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        n = group.size
        parts = torch.stack(grad.chunk(n, dim=2)).contiguous()  # (n, B, H, T / C, D)
        out = torch.empty(parts.shape[1:], dtype=grad.dtype, device=grad.device)
        group.reduce_scatter(out, parts)
        return out, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommGroup,
                         seq_len: int, layout: str = "load_balanced", dropout_p: float = 0.0,
                         enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    ``q`` ``(B, nh, T / C, hs)``, ``k`` and ``v`` ``(B, ng, T / C, hs)``: this CP rank's
    tokens (:func:`cp_positions` order) of a ``seq_len``-token sequence. K and V are
    all-gathered over ``group`` (the CP group); returns ``(B, nh, T / C, hs)``.
    """
    c, r = group.size, group.rank
    k_all = _GatherSequence.apply(k, group)
    v_all = _GatherSequence.apply(v, group)
    q_pos = cp_positions(seq_len, c, r, layout).to(q.device)
    k_pos = torch.cat([cp_positions(seq_len, c, j, layout) for j in range(c)]).to(q.device)
    mask = q_pos[:, None] >= k_pos[None, :]  # (T / C, T): global causality
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, dropout_p=dropout_p,
                                          enable_gqa=enable_gqa)
