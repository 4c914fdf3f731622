"""Experts split over the expert-parallel group: an MoE layer's assignments go to their
expert's rank by all-to-all, run there, and come back (the middle step of
:class:`models.moe.MoE`, [Note: three steps] there).

    out = run_experts(rows, counts, ep_group, experts)   # rows: (N, C), sorted by expert

``rows`` are this rank's ``N`` assignments' inputs sorted by global expert, stably (an
expert's rows in token order); ``counts`` ``(E,)`` int64 how many each global expert got
here. EP rank ``r`` holds experts ``[r E / EP, (r + 1) E / EP)``; ``experts(x, counts)``
runs each local expert on its run of ``x`` (sorted by local expert, ``counts`` per
expert; one with no rows skipped): the layer's grouped MLP. The result is ``rows``'
outputs, in ``rows``' order.

[Note: the exchange]
1. **Counts.** One all-to-all of the ``(E,)`` counts (equal chunks of ``E / EP``) tells
   each rank how many rows each source rank sends for each of its experts,
   ``recv[j, e]``; the splits go to the host (one sync: the next exchange's sizes must
   be known there).
2. **Rows.** An all-to-all of unequal splits: a source sends its rows sorted by expert,
   so they arrive grouped by source rank, then by expert.
3. **Compute.** Each local expert runs once on all its rows, taken in source-rank order
   (one permutation, computed from the counts), so every expert sees its rows in the
   same order whatever the timing; an expert with no rows is skipped (its weights get a
   zero gradient).
4. **Back.** The reverse all-to-all gives each rank its own rows' outputs, in its order.

[Note: every rank joins the backward]
A backward exchange runs on a rank only if autograd reaches it there, and every rank of
the group must join it. A rank whose experts got no rows computes nothing from what it
received: without care its graph would stop there, its backward skip the first
exchange's reverse, and the other ranks wait for it until the timeout. So both
exchanges take a 0-dim ``anchor`` that requires grad (the node is recorded whatever the
rows), and an empty computation is kept on the path as ``x * 0``.

Both all-to-alls are autograd functions whose backward is the reverse exchange; every
exchange runs through the group's door (:class:`hybrid.parallel.comm.CommGroup`:
counted, under the timeouts, in the flight recorder). A rank whose tokens all go
elsewhere, or whose experts get none, still joins every exchange with empty splits. At
EP 1 nothing is exchanged: the experts run in order on the rows as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid.parallel.comm import CommGroup

Experts = Callable[[torch.Tensor, list[int]], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """Rows to the group's ranks by ``in_splits``, ``out_splits`` received; backward: the
    reverse exchange. ``anchor``: a 0-dim tensor that requires grad ([Note: every rank
    joins the backward])."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, anchor: torch.Tensor, group: CommGroup,
                out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
        group.all_to_all_v(out, inp.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.group.all_to_all_v(back, grad.contiguous(), ctx.in_splits, ctx.out_splits)
        return back, None, None, None, None


def exchange_blocks(rows: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Block ``j`` of ``rows`` (dim 0 in ``group.size`` equal blocks) to group rank ``j``;
    block ``j`` of the result is what rank ``j`` sent here (DeepSpeed's MoE exchange: every
    expert's fixed-capacity block). Its backward is the reverse exchange; every rank joins
    it ([Note: every rank joins the backward])."""
    if group.size == 1:
        return rows
    if rows.shape[0] % group.size:
        raise ValueError(f"{rows.shape[0]} rows do not split in {group.size} equal blocks")
    splits = [rows.shape[0] // group.size] * group.size
    anchor = torch.zeros((), device=rows.device, requires_grad=torch.is_grad_enabled())
    return _AllToAll.apply(rows, anchor, group, splits, splits)


class _GatherRows(torch.autograd.Function):
    """Every ETP rank's rows ``(n_r, C)``, padded to the largest ``n``, stacked: ``(etp,
    n, C)``; backward: the gradients summed over the group and this rank's rows kept
    (reduce-scatter). ``anchor`` as :class:`_AllToAll`'s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, group: CommGroup, n: int):
        ctx.group, ctx.rows = group, x.shape[0]
        padded = x.new_zeros((n, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((group.size, n, *x.shape[1:]))
        group.all_gather(out, padded)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = grad.new_empty(grad.shape[1:])
        ctx.group.reduce_scatter(mine, grad.contiguous())
        return mine[: ctx.rows], None, None, None


class _SumRows(torch.autograd.Function):
    """The reverse of :class:`_GatherRows`: ``(etp, n, C)`` partial outputs summed over the
    ETP group, block ``r`` to rank ``r``, its first ``rows`` kept (reduce-scatter);
    backward: the all-gather."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: CommGroup, rows: int):
        ctx.group, ctx.n = group, y.shape[1]
        mine = y.new_empty(y.shape[1:])
        group.reduce_scatter(mine, y.contiguous())
        return mine[:rows]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        padded = grad.new_zeros((ctx.n, *grad.shape[1:]))
        padded[: grad.shape[0]] = grad
        out = grad.new_empty((ctx.group.size, ctx.n, *grad.shape[1:]))
        ctx.group.all_gather(out, padded)
        return out, None, None


def run_sharded(rows: torch.Tensor, counts: list[int], experts: Experts,
                etp: CommGroup | None) -> torch.Tensor:
    """Each local expert on its run of ``rows`` (sorted by expert, ``counts`` per expert).
    ``etp`` (expert tensor parallelism): each rank of that group holds a slice of every
    local expert's hidden units, ``experts`` giving partial outputs; the group's
    rows are gathered (sizes first: one all-gather of the counts, one host read), each
    expert runs on its rows of every ETP rank (in ETP rank order), and the partial
    outputs are summed back to the rank that sent each row (reduce-scatter). Every rank
    of the group joins both exchanges, forward and backward, whatever its rows."""
    if etp is None or etp.size == 1:
        return experts(rows, counts)
    local = len(counts)
    mine = torch.tensor(counts, dtype=torch.int64, device=rows.device)
    every = torch.empty(etp.size * local, dtype=torch.int64, device=rows.device)
    etp.all_gather(every, mine)
    every = every.view(etp.size, local).cpu()  # (etp, local): rows per rank and expert
    n = int(every.sum(dim=1).max())
    anchor = torch.zeros((), device=rows.device, requires_grad=torch.is_grad_enabled())
    gathered = _GatherRows.apply(rows, anchor, etp, n)  # (etp, n, C)
    # expert-major, ETP-rank-minor: a run per expert, its ranks' rows in rank order
    starts = torch.cumsum(every, dim=1) - every + torch.arange(etp.size)[:, None] * n
    lengths, firsts = every.t().reshape(-1), starts.t().reshape(-1)
    run_start = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    order = (torch.repeat_interleave(firsts, lengths) + torch.arange(total)
             - torch.repeat_interleave(run_start, lengths)).to(rows.device)
    flat = gathered.reshape(-1, *rows.shape[1:])
    x = flat[order]
    computed = experts(x, every.sum(dim=0).tolist())
    if x.requires_grad and not computed.requires_grad:  # no rows in the group: keep the path
        computed = x * 0
    partial = torch.zeros_like(flat).index_copy(0, order, computed)
    return _SumRows.apply(partial.view(etp.size, n, *rows.shape[1:]), etp, rows.shape[0])


def run_experts(rows: torch.Tensor, counts: torch.Tensor, group: CommGroup | None,
                experts: Experts, etp: CommGroup | None = None) -> torch.Tensor:
    """The outputs of ``rows`` from their experts, over the EP ``group`` (module doc; None:
    EP 1), each expert's hidden units split over ``etp`` when given (:func:`run_sharded`)."""
    ep, total = 1 if group is None else group.size, counts.numel()
    if group is None or ep == 1:
        return run_sharded(rows, counts.tolist(), experts, etp)
    if total % ep:
        raise ValueError(f"{total} experts do not split over EP {ep}")
    local = total // ep
    # 1. counts: recv[j, e] rows source j sends for local expert e
    recv = torch.empty_like(counts)
    group.all_to_all(recv, counts.contiguous())
    recv = recv.view(ep, local).cpu()
    in_splits = counts.view(ep, local).sum(dim=1).tolist()
    out_splits = recv.sum(dim=1).tolist()
    # 2. rows, grouped by source rank, then by expert
    anchor = torch.zeros((), device=rows.device, requires_grad=torch.is_grad_enabled())
    got = _AllToAll.apply(rows, anchor, group, out_splits, in_splits)
    # 3. expert-major, source-minor: a run per expert, its sources in rank order
    flat = recv.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(ep, local)
    lengths, firsts = recv.t().reshape(-1), starts.t().reshape(-1)
    run_start = torch.cumsum(lengths, 0) - lengths
    n = int(lengths.sum())
    order = (torch.repeat_interleave(firsts, lengths)
             + torch.arange(n) - torch.repeat_interleave(run_start, lengths)).to(rows.device)
    x = got[order]
    computed = run_sharded(x, recv.sum(dim=0).tolist(), experts, etp)
    if x.requires_grad and not computed.requires_grad:  # no rows here: keep the path
        computed = x * 0
    back = torch.empty_like(computed).index_copy(0, order, computed)
    # 4. each rank's rows back, in its order
    return _AllToAll.apply(back, anchor, group, in_splits, out_splits)
