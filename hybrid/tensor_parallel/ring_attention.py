"""Causal attention over a sequence split across the CP group, block by block.

[Note: blockwise attention with a merge]
A rank's queries meet the keys of every CP rank (its *sources*) one source at a
time. Each block (:func:`hybrid.tensor_parallel.context_parallel.plan_blocks`)
gives a partial output and the log-sum-exp of its scores; partials merge
exactly (the online softmax)::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Backward needs only the final ``out`` and ``lse``: a block's probabilities are
``exp(scores - lse)`` again, and with ``delta = rowsum(dout * out)`` its
gradients follow without the other blocks (``dS = P * (dP - delta)``). Scores,
probabilities and accumulators are fp32 whatever the input dtype.

Two ways to meet the sources:

* **p2p** (ring): K and V travel around the CP group, one hop per step, the
  next block's transfer running while this one computes; in backward the
  K/V gradients travel with them and arrive home after C hops. Memory: two
  K/V blocks, whatever C.
* **all_gather**: K and V of every rank gathered once per layer (again in
  backward, rather than kept), their gradients reduce-scattered home. Memory:
  the whole sequence's K and V.

[Note: dropout that does not depend on the layout]
Attention dropout here keeps pair (b, head, query position, key position)
when a hash of those four numbers and a per-call seed passes the threshold:
the same pair gets the same mask at any CP size, layout or comm type, so a CP
run with dropout equals one process's bit for bit in the mask. The seed is
drawn on the host (:func:`draw_dropout_seed`) from the default CPU generator,
which every TP and CP rank of a DP replica seeds alike and activation
recompute replays; heads are global (TP offset included).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.context_parallel import (
    Block,
    Segment,
    block_mask,
    plan_blocks,
    segments,
)


class Spec(NamedTuple):
    """What every block of one attention call shares."""
    scale: float
    groups: int  # query heads per K/V head (GQA)
    dropout: float
    seed: int
    first_head: int  # global index of the first local query head (TP, and a2a's CP share)


def draw_dropout_seed() -> int:
    """One seed per attention call from the default CPU generator (see the module note)."""
    return int(torch.randint(0, 2**31 - 1, (1,)))


# -- dropout mask: a counter-based hash ----------------------------------------
_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 values below 2**32; the products
    wrap past 2**63, whose low 32 bits are still right."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def keep_mask(spec: Spec, b: Block, batch: int, heads: int, device) -> torch.Tensor:
    """``(B, nh, len q, len k)`` bool: the pairs dropout keeps in block ``b``."""
    head = torch.arange(spec.first_head, spec.first_head + heads, device=device)
    bh = torch.arange(batch, device=device)[:, None] * 65599 + head[None, :]
    seed = torch.full((), spec.seed, dtype=torch.int64, device=device)  # (no host copy)
    h = _mix(_mix(seed) ^ bh)[:, :, None, None]
    h = _mix(h ^ b.q.positions(device)[:, None])
    h = _mix(h ^ _mix(b.k.positions(device) + 0x9E3779B9))
    return h >= int(spec.dropout * 2**32)


# -- one source: the blocks of this rank's queries against one rank's keys ----
def _expand(t: torch.Tensor, g: int) -> torch.Tensor:
    """``(B, ng, T, D)`` -> ``(B, ng * g, T, D)``: each K/V head for its g query heads."""
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _fold(t: torch.Tensor, g: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: sum over each K/V head's query heads."""
    if g == 1:
        return t
    B, H, T, D = t.shape
    return t.view(B, H // g, g, T, D).sum(2)


def _cols(s: Segment) -> slice:
    return slice(s.start, s.start + s.length)


def _scores(q: torch.Tensor, k: torch.Tensor, b: Block, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # (B, nh, len q, len k) fp32
    mask = block_mask(b, q.device)
    return s if mask is None else s.masked_fill_(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isinf(lse), 0.0)  # rows with no key yet: subtract 0


def forward_source(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_segs: tuple[Segment, ...], k_segs: tuple[Segment, ...], spec: Spec,
                   out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge the blocks of queries ``qf`` ``(B, nh, Tq, D)`` fp32 against one source's
    ``k``, ``v`` ``(B, ng, Tk, D)`` into ``out`` ``(B, nh, Tq, D)`` and ``lse``
    ``(B, nh, Tq)`` (fp32, in place)."""
    kf, vf = _expand(k.float(), spec.groups), _expand(v.float(), spec.groups)
    for b in plan_blocks(q_segs, k_segs):
        qs, ks = _cols(b.q), _cols(b.k)
        s = _scores(qf[:, :, qs], kf[:, :, ks], b, spec.scale)
        lse_b = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite(lse_b)[..., None])
        if spec.dropout > 0:
            p = p * keep_mask(spec, b, qf.shape[0], qf.shape[1], qf.device) / (1 - spec.dropout)
        o, lo = out[:, :, qs], lse[:, :, qs]  # views: merged in place
        new = torch.logaddexp(lo, lse_b)
        safe = _finite(new)
        o.mul_(torch.exp(lo - safe)[..., None]).add_(
            torch.matmul(p, vf[:, :, ks]) * torch.exp(lse_b - safe)[..., None])
        lo.copy_(new)


def backward_source(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    q_segs: tuple[Segment, ...], k_segs: tuple[Segment, ...], spec: Spec,
                    lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor,
                    dq: torch.Tensor) -> torch.Tensor:
    """Add the blocks' query gradients into ``dq`` (fp32, in place) and return this
    source's ``(2, B, ng, Tk, D)`` fp32 [dK, dV] (see [Note: blockwise attention])."""
    g = spec.groups
    kf, vf = _expand(k.float(), g), _expand(v.float(), g)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    for b in plan_blocks(q_segs, k_segs):
        qs, ks = _cols(b.q), _cols(b.k)
        p = torch.exp(_scores(qf[:, :, qs], kf[:, :, ks], b, spec.scale) - lse[:, :, qs, None])
        do = dout[:, :, qs]
        dp = torch.matmul(do, vf[:, :, ks].transpose(-1, -2))
        if spec.dropout > 0:
            keep = keep_mask(spec, b, qf.shape[0], qf.shape[1], qf.device) / (1 - spec.dropout)
            dv[:, :, ks] += torch.matmul((p * keep).transpose(-1, -2), do)
            dp = dp * keep
        else:
            dv[:, :, ks] += torch.matmul(p.transpose(-1, -2), do)
        ds = p * (dp - delta[:, :, qs, None]) * spec.scale
        dq[:, :, qs] += torch.matmul(ds, kf[:, :, ks])
        dk[:, :, ks] += torch.matmul(ds.transpose(-1, -2), qf[:, :, qs])
    return torch.stack([_fold(dk, g), _fold(dv, g)])


def _start(q: torch.Tensor):
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device)
    return q.float(), out, torch.full((B, H, T), float("-inf"), device=q.device)


def _forward_end(ctx, q, k, v, out, lse, args):
    """Save what backward recomputes from (no scores: see the module note); ``out`` in
    the input dtype."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = args
    return out.to(q.dtype)


def _backward_start(ctx, dy):
    """((q, k, v, lse), dout, delta, q in fp32, zero dq) from a Function saving
    (q, k, v, out, lse): what every backward of these blocks begins with."""
    q, k, v, out, lse = ctx.saved_tensors
    dout = dy.float()
    return (q, k, v, lse), dout, (dout * out).sum(-1), q.float(), torch.zeros_like(out)


# -- the two exchanges ---------------------------------------------------------
class RingAttention(torch.autograd.Function):
    """``q`` ``(B, nh, T / C, D)``, ``k``, ``v`` ``(B, ng, T / C, D)`` -> ``(B, nh, T / C, D)``.
    Forward: C - 1 ring exchanges of [K; V] over ``group``; backward: C - 1 of [K; V] and
    C of [dK; dV] (fp32). Each overlaps the block computing beside it."""

    @staticmethod
    def forward(ctx, q, k, v, group: CommGroup, seq_len: int, layout: str, spec: Spec):
        C, r = group.size, group.rank
        qf, out, lse = _start(q)
        kv = torch.stack([k, v])
        for step in range(C):
            work = None
            if step + 1 < C:  # the next source's K/V, in flight while this one computes
                nxt = torch.empty_like(kv)
                work = group.ring_exchange(nxt, kv, async_op=True)
            src = (r - step) % C
            forward_source(qf, kv[0], kv[1], segments(seq_len, C, r, layout),
                           segments(seq_len, C, src, layout), spec, out, lse)
            if work is not None:
                work.wait()
                kv = nxt
        return _forward_end(ctx, q, k, v, out, lse, (group, seq_len, layout, spec))

    @staticmethod
    def backward(ctx, dy):
        (q, k, v, lse), dout, delta, qf, dq = _backward_start(ctx, dy)
        group, seq_len, layout, spec = ctx.args
        C, r = group.size, group.rank
        kv, pending, acc = torch.stack([k, v]), None, None
        for step in range(C):
            work = None
            if step + 1 < C:
                nxt = torch.empty_like(kv)
                work = group.ring_exchange(nxt, kv, async_op=True)
            src = (r - step) % C
            dkv = backward_source(qf, kv[0], kv[1], segments(seq_len, C, r, layout),
                                  segments(seq_len, C, src, layout), spec, lse, dout, delta, dq)
            if pending is not None:  # what the ranks before added to this source's dK/dV
                assert acc is not None  # (its buffer)
                pending.wait()
                dkv += acc
            acc = torch.empty_like(dkv)
            pending = group.ring_exchange(acc, dkv, async_op=True)  # on to the next rank
            if work is not None:
                work.wait()
                kv = nxt
        assert pending is not None and acc is not None  # (C >= 1: one hop at least)
        pending.wait()  # after C hops: this rank's own dK/dV, summed over every rank
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None, None


class GatheredAttention(torch.autograd.Function):
    """Same contract as :class:`RingAttention`. Forward and backward each all-gather
    [K; V] over ``group`` once; backward reduce-scatters [dK; dV] (fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, group: CommGroup, seq_len: int, layout: str, spec: Spec):
        C, r = group.size, group.rank
        qf, out, lse = _start(q)
        kv_all = _gather(torch.stack([k, v]), group)
        for src in _own_first(C, r):
            forward_source(qf, kv_all[src, 0], kv_all[src, 1], segments(seq_len, C, r, layout),
                           segments(seq_len, C, src, layout), spec, out, lse)
        return _forward_end(ctx, q, k, v, out, lse, (group, seq_len, layout, spec))

    @staticmethod
    def backward(ctx, dy):
        (q, k, v, lse), dout, delta, qf, dq = _backward_start(ctx, dy)
        group, seq_len, layout, spec = ctx.args
        C, r = group.size, group.rank
        kv_all = _gather(torch.stack([k, v]), group)
        dkv_all = torch.empty((C, 2, *k.shape), dtype=torch.float32, device=k.device)
        for src in _own_first(C, r):
            dkv_all[src] = backward_source(qf, kv_all[src, 0], kv_all[src, 1],
                                           segments(seq_len, C, r, layout),
                                           segments(seq_len, C, src, layout), spec, lse, dout,
                                           delta, dq)
        mine = torch.empty_like(dkv_all[0])
        group.reduce_scatter(mine, dkv_all)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None


def _gather(kv: torch.Tensor, group: CommGroup) -> torch.Tensor:
    out = torch.empty((group.size, *kv.shape), dtype=kv.dtype, device=kv.device)
    group.all_gather(out, kv.contiguous())
    return out


def _own_first(size: int, rank: int) -> list[int]:
    """Sources in order, this rank's first: its block holds every query's own key, so
    every row's log-sum-exp is finite from the first merge on."""
    return [(rank - i) % size for i in range(size)]


class LocalAttention(torch.autograd.Function):
    """Causal attention of whole sequences in position order on one rank, by the same
    blocks (the all-to-all exchange's attention when it has dropout: the layout-free
    mask of the module note). ``(B, nh, T, D)``, ``(B, ng, T, D)`` x 2 -> ``(B, nh, T, D)``."""

    @staticmethod
    def forward(ctx, q, k, v, spec: Spec):
        seg = (Segment(0, q.shape[2], 0, 1),)
        qf, out, lse = _start(q)
        forward_source(qf, k, v, seg, seg, spec, out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dy):
        (q, k, v, lse), dout, delta, qf, dq = _backward_start(ctx, dy)
        seg = (Segment(0, q.shape[2], 0, 1),)
        dkv = backward_source(qf, k, v, seg, seg, ctx.spec, lse, dout, delta, dq)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
