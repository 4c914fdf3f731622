"""Every rank agrees on a value only some ranks know: the first error, the largest number.

A rank that decides alone -- to stop, to raise -- leaves the others waiting in
their next collective until it times out. These turn a rank-local fact into the
same answer on every rank with one or two small collectives over the world, so
all ranks take the same branch.
"""

from __future__ import annotations

import torch

from hybrid.parallel.state import ParallelState


def agree_error(ps: ParallelState, error: str | None) -> str | None:
    """None when no rank failed; else the message of the lowest failing rank, on every
    rank. Collective over the world, so all ranks take the same branch, and the error a
    job prints (rank 0's) names the file that actually failed, whichever rank hit it."""
    g = ps.world_group
    first = torch.tensor([ps.rank if error is not None else ps.world_size], dtype=torch.int64,
                         device=ps.device)
    g.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
    src = int(first.item())
    if src == ps.world_size:
        return None
    data = error.encode() if error is not None and ps.rank == src else b""  # (src's is)
    size = torch.tensor([len(data)], dtype=torch.int64, device=ps.device)
    g.broadcast(size, src=src)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=ps.device)
    if ps.rank == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    g.broadcast(buf, src=src)
    return bytes(buf.cpu().tolist()).decode(errors="replace")


def max_over_ranks(ps: ParallelState, values: list[float]) -> list[float]:
    """The element-wise maximum of ``values`` over every rank, on every rank (one
    float64 all-reduce of ``len(values)`` elements over the world, one host read)."""
    t = torch.tensor(values, dtype=torch.float64, device=ps.device)
    ps.world_group.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()
