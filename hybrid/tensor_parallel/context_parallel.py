"""Context parallelism's arithmetic: which tokens a CP rank holds, and which blocks of
causal attention it computes.

[Note: which tokens a CP rank holds]
Causal attention's work grows along the sequence (token i attends to i + 1
keys), so equal contiguous slices would give the last rank the most work.
Two layouts even it out, both as a list of global positions per rank
(:func:`cp_positions`):

* ``load_balanced`` (Megatron's): the sequence is cut into 2C chunks and rank
  r holds chunks r and 2C - 1 - r -- an early and a late chunk, whose causal
  work sums to the same for every rank (exactly: :func:`causal_pairs`);
* ``striped`` (Striped Attention): token i to rank i mod C.

Everything that depends on a token's position (RoPE, learned position
embeddings, the causal mask, the dropout mask) reads these global positions,
never the local index.

[Note: segments and blocks]
A rank's tokens are a few *segments*, runs of positions ``first + i * stride``:
two contiguous chunks (load_balanced) or one stride-C run (striped). Attention
of one rank's queries to another's keys is computed per (query segment, key
segment) *block*, classified from the segments' ends alone (host integers, no
device read): every key before every query (``full``, no mask), every key after
(skipped), or in between (``causal``, a mask from positions). In the
load-balanced layout each rank computes 2C - 1 full and 2 causal chunk blocks
over the C sources; striped blocks are all causal (:func:`attention_work`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from hybrid.config.sections import CP_LAYOUTS


class Segment(NamedTuple):
    """Local tokens ``[start, start + length)`` at global positions ``first + i * stride``."""
    start: int
    length: int
    first: int
    stride: int

    @property
    def last(self) -> int:
        return self.first + (self.length - 1) * self.stride

    def positions(self, device=None) -> torch.Tensor:
        return torch.arange(self.length, device=device) * self.stride + self.first


class Block(NamedTuple):
    """Queries ``q`` attend keys ``k``; ``causal``: some pairs are masked out."""
    q: Segment
    k: Segment
    causal: bool


def check_seq_len(seq_len: int, cp_size: int, layout: str) -> None:
    """ValueError unless ``seq_len`` splits evenly in ``layout`` over ``cp_size`` ranks."""
    if layout not in CP_LAYOUTS:
        raise ValueError(f"context-parallel layout must be one of {CP_LAYOUTS}, got {layout!r}")
    if layout == "striped" and seq_len % cp_size:
        raise ValueError(f"sequence length {seq_len} is not a multiple of the "
                         f"context-parallel size {cp_size}")
    if layout == "load_balanced" and seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x the "
                         f"context-parallel size {cp_size} (the load-balanced layout cuts it "
                         f"into {2 * cp_size} chunks)")


@functools.lru_cache(maxsize=256)
def segments(seq_len: int, cp_size: int, cp_rank: int,
             layout: str = "load_balanced") -> tuple[Segment, ...]:
    """``cp_rank``'s tokens of a ``seq_len``-token sequence, as segments in local order."""
    check_seq_len(seq_len, cp_size, layout)
    if layout == "striped":
        return (Segment(0, seq_len // cp_size, cp_rank, cp_size),)
    c = seq_len // (2 * cp_size)
    return (Segment(0, c, cp_rank * c, 1), Segment(c, c, (2 * cp_size - 1 - cp_rank) * c, 1))


def cp_positions(seq_len: int, cp_size: int, cp_rank: int,
                 layout: str = "load_balanced") -> torch.Tensor:
    """Global positions (``(seq_len / cp_size,)`` int64, ascending) of ``cp_rank``'s
    tokens. ``seq_len`` must be a multiple of 2 x cp_size (load_balanced) or cp_size."""
    return torch.cat([s.positions() for s in segments(seq_len, cp_size, cp_rank, layout)])


def cp_shard(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int,
             layout: str = "load_balanced") -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` (a full sequence), in position order."""
    pos = cp_positions(x.shape[dim], cp_size, cp_rank, layout).to(x.device)
    return x.index_select(dim, pos)


def plan_blocks(q_segs: tuple[Segment, ...], k_segs: tuple[Segment, ...]) -> list[Block]:
    """The blocks of causal attention from queries ``q_segs`` to keys ``k_segs`` that
    hold at least one unmasked pair (see [Note: segments and blocks])."""
    out = []
    for q in q_segs:
        for k in k_segs:
            if q.last < k.first:
                continue  # every key after every query
            out.append(Block(q, k, causal=q.first < k.last))
    return out


def block_mask(b: Block, device) -> torch.Tensor | None:
    """``(len q, len k)`` bool, True where the query may see the key; None: all."""
    if not b.causal:
        return None
    return b.q.positions(device)[:, None] >= b.k.positions(device)[None, :]


def attention_work(seq_len: int, cp_size: int, cp_rank: int,
                   layout: str = "load_balanced") -> int:
    """(query, key) score elements ``cp_rank`` computes over all C sources: the sum of
    its blocks' areas (masked pairs inside a causal block included)."""
    mine = segments(seq_len, cp_size, cp_rank, layout)
    return sum(b.q.length * b.k.length for j in range(cp_size)
               for b in plan_blocks(mine, segments(seq_len, cp_size, j, layout)))


def causal_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """(query, key) pairs the causal mask keeps: the attention work of these queries."""
    return int((q_pos[:, None] >= k_pos[None, :]).sum())
