"""Gradient reduction over the DP group, launched from autograd hooks as units fill.

A post-accumulate-grad hook on every parameter counts arrivals per unit; when
a unit's last gradient lands, its reduction starts -- asynchronously with
``--overlap-comm`` (communication runs while backward computes the next
units), synchronously otherwise. ``finish()`` waits for what is in flight.

What "reduce" means per stage:

* stage 0: all-reduce the unit's slice of the flat gradient buffer in place,
  in chunks of at most a bucket;
* stage 1: reduce-scatter it in place: this rank's shard gets the sum (a
  unit larger than a bucket is staged in pieces like stage 2);
* stages 2, 3: there is no full gradient buffer. The unit's gradients are
  packed into a temporary (at most ``bucket`` elements, from a pool of two),
  reduce-scattered, and this rank's part is added to its gradient shard; the
  parameters' ``.grad`` are dropped at once. This happens for every
  micro-batch, since nothing else could hold the full gradients.

Stages 0 and 1 accumulate micro-batches in the flat buffer and reduce only
when ``begin(sync=True)`` announced the last micro-batch.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from hybrid.comm import CommGroup
from hybrid.zero.flat_unit import FlatUnit, piece_columns


class _TempPool:
    """A fixed number of reusable staging buffers: constant communication memory."""

    def __init__(self, count: int, numel: int, dtype, device):
        self.free = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]
        self.bytes = sum(t.numel() * t.element_size() for t in self.free)

    def take(self) -> torch.Tensor | None:
        return self.free.pop() if self.free else None

    def give(self, t: torch.Tensor) -> None:
        self.free.append(t)


class GradReducer:
    def __init__(self, units: list[FlatUnit], stage: int, dp: CommGroup, bucket: int,
                 overlap: bool, on_reduced: Callable[[FlatUnit], None] | None = None):
        self.units, self.stage, self.dp = units, stage, dp
        self.bucket, self.overlap = bucket, overlap
        self.on_reduced = on_reduced
        self.sync = True
        self._arrived = {id(u): 0 for u in units}
        self._inflight: deque = deque()  # (work, finalize)
        self.pool = None
        staged = [u for u in units if stage >= 2 or dp.size * u.shard_size > bucket]
        if stage >= 1 and staged:
            # Staging holds one piece (dp x columns): at most the bucket, and no more
            # than the largest unit needs.
            biggest = max(dp.size * piece_columns(u.shard_size, dp.size, bucket) for u in staged)
            p0 = units[0].params[0]
            self.pool = _TempPool(2, biggest, p0.dtype, p0.device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(u))
                       for u in units for p in u.params]

    def temp_bytes(self) -> int:
        """Bytes of staging buffers: the largest temporary communication memory."""
        return self.pool.bytes if self.pool else 0

    def begin(self, sync: bool) -> None:
        """Before a micro-batch's backward; ``sync`` marks the last one of the step."""
        self.sync = sync
        for k in self._arrived:
            self._arrived[k] = 0

    def _hook(self, unit: FlatUnit):
        def on_grad(param):
            self._arrived[id(unit)] += 1
            if self._arrived[id(unit)] == len(unit.params):
                self._unit_ready(unit)
        return on_grad

    def _unit_ready(self, unit: FlatUnit) -> None:
        if self.stage <= 1:
            if self.sync:
                self._reduce_in_place(unit)
        else:
            self._reduce_scatter_staged(unit, accumulate=True)
            for p in unit.params:
                p.grad = None  # the shard holds this rank's part now
            if self.on_reduced is not None:
                self.on_reduced(unit)

    # -- stages 0 and 1: the flat gradient buffer is permanent -----------------
    def _reduce_in_place(self, unit: FlatUnit) -> None:
        g, scale, n = unit.grad_full, 1.0 / self.dp.size, self.dp.size
        if self.stage == 0:  # contiguous chunks of at most a bucket, in place
            for a in range(0, g.numel(), self.bucket):
                chunk = g[a: a + self.bucket]
                self._push(self.dp.all_reduce(chunk, async_op=True),
                           lambda chunk=chunk: chunk.mul_(scale))
        elif n * unit.shard_size <= self.bucket:
            own = g[unit.own_lo: unit.own_hi]
            self._push(self.dp.reduce_scatter(own, g, async_op=True), lambda: own.mul_(scale))
        else:  # a unit larger than a bucket: stage it in pieces
            self._reduce_scatter_staged(unit, accumulate=False)

    # -- stages 2 and 3: stage through the pool --------------------------------
    def _reduce_scatter_staged(self, unit: FlatUnit, accumulate: bool = True) -> None:
        """Reduce-scatter ``unit``'s grads piece by piece through pool buffers.

        ``accumulate``: add into the gradient shard (stages 2-3 sum micro-batches
        there); otherwise overwrite it (stage 1, whose shard is a view of the
        very gradients being reduced).
        """
        S, n = unit.shard_size, self.dp.size
        c = piece_columns(S, n, self.bucket)
        scale = 1.0 / n
        for k in range(0, S, c):
            w = min(c, S - k)
            tmp = self.pool.take()
            while tmp is None:  # both buffers in flight: retire the oldest
                self._retire_one()
                tmp = self.pool.take()
            grid = tmp[: n * w].view(n, w)
            for r in range(n):  # rank r's columns [k, k + w) of its shard
                unit.copy_range(r * S + k, r * S + k + w, grid[r], grads=True)
            mine = grid[self.dp.rank]
            work = self.dp.reduce_scatter(mine, tmp[: n * w], async_op=True)
            dst = unit.grad_shard[k: k + w]

            def finalize(dst=dst, mine=mine, tmp=tmp):
                if accumulate:
                    dst.add_(mine, alpha=scale)
                else:
                    torch.mul(mine, scale, out=dst)
                self.pool.give(tmp)
            self._push(work, finalize)

    # -- in-flight bookkeeping -------------------------------------------------
    def _push(self, work, finalize) -> None:
        self._inflight.append((work, finalize))
        if not self.overlap:
            self._retire_one()

    def _retire_one(self) -> None:
        work, finalize = self._inflight.popleft()
        work.wait()
        finalize()

    def finish(self) -> None:
        """Wait for every launched reduction (call after each backward)."""
        while self._inflight:
            self._retire_one()
        if self.sync or self.stage >= 2:
            missing = [u.name for u in self.units
                       if self._arrived[id(u)] != len(u.params)]
            if missing:
                raise RuntimeError(f"ZeRO: parameters of units {missing[:3]} got no gradient "
                                   f"this backward; every rank must reduce every unit")

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
