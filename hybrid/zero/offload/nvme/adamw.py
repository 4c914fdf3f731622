"""AdamW whose fp32 master and moments live on disk (the nvme tier, ZeRO-Infinity).

The host tier (:class:`~hybrid.zero.optimizer.ShardedAdamW` under
:class:`~hybrid.zero.offload.host_step.OptimizerOffload`) keeps the rank's flat shard
of master weights and moments in host memory and updates it unit by unit.
This one keeps the same flat shard in :class:`~hybrid.zero.offload.nvme.tiles.SwappedStates`
and updates it tile by tile as the tiles stream through the staging buffers;
everything else -- the gradients' way down, the worker thread, the delayed
update, the parameters' way up -- is the host tier's, unchanged.

[Note: bit-identical to the host tier]
Both call :func:`hybrid.kernels.adam.adam_step` with the same step scalars,
hyper-parameters and per-element decay flags; only the pieces differ (units
there, tiles here). The compiled step is piece-exact (its docstring: one
element's arithmetic does not depend on the call's bounds), so every master
and moment element ends with the same bits, and so does the curve.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Generator, Iterable
from dataclasses import dataclass

import torch

from hybrid.config.sections import AdamWConfig
from hybrid.kernels.adam import AdamSegments, adam_step
from hybrid.zero.offload.nvme.tiles import SwappedStates, Tile
from hybrid.zero.optimizer import PartRanges, ShardBase


class SwappedAdamW(ShardBase):
    """The shard optimizer of the nvme tier: the
    :class:`~hybrid.zero.offload.contracts.ShardOptimizer` contract (the host step's
    ``chunks``, ``chunk_steps``, ``master_into``, ``master_range``; the checkpoint's
    ``read_piece``, ``write_piece``) over tiles on disk. It has no device ``step``:
    the nvme tier always steps on the host, through ``chunk_steps``.

    Args:
        sizes: elements of each part (unit), in shard order.
        decay_ranges, split_ranges: per part, as
            :class:`~hybrid.zero.optimizer.ShardedAdamW` takes them.
        states: the swapped master and moments of the whole flat shard.
        excluded: parts left out of the norm (:class:`~hybrid.zero.optimizer.ShardBase`).
    """

    def __init__(self, sizes: list[int], decay_ranges: PartRanges, split_ranges: PartRanges,
                 cfg: AdamWConfig, *,
                 states: SwappedStates, excluded: Collection[int] = ()):
        super().__init__(sizes, split_ranges, torch.device("cpu"), excluded)
        self.states = states
        self.cfg = cfg  # the hyper-parameters
        flat = sorted((self.offsets[i] + a, self.offsets[i] + b)
                      for i, ranges in enumerate(decay_ranges) for a, b in ranges if b > a)
        self._decay_lo = [a for a, _ in flat]
        self._decay = flat
        self._segs: dict[int, AdamSegments] = {}
        self.master = self.exp_avg = self.exp_avg_sq = None  # on disk: read_piece
        self.flat_master = None
        self._spec: _Speculation | None = None  # the held tiles' update, until the step
        # tiles, summed over steps: updated ahead of the step, then used or discarded by it
        self.speculation = {"speculated": 0, "used": 0, "discarded": 0}

    def _segments(self, k: int) -> AdamSegments:
        """Decay segments of tile ``k`` in tile coordinates (cached: a tile's are fixed)."""
        if k not in self._segs:
            lo, hi = self.states.bounds(k)
            first = max(0, bisect.bisect_right(self._decay_lo, lo) - 1)
            ranges = []
            for a, b in self._decay[first:]:
                if a >= hi:
                    break
                if b > lo:
                    ranges.append((max(a, lo) - lo, min(b, hi) - lo))
            self._segs[k] = AdamSegments.from_ranges(hi - lo, ranges, torch.device("cpu"))
        return self._segs[k]

    def state_bytes(self) -> int:
        return self.states.nbytes()  # host staging; the states themselves are on disk

    # -- the host step's interface ------------------------------------------------------
    def chunks(self) -> list[tuple[int, int]]:
        return [self.states.bounds(k) for k in range(self.states.tiles)]

    def prefetch(self) -> int:
        """The first tiles' states start coming off the disk into the staging buffers
        the next ascending :meth:`chunk_steps` reads them into ([Note: reading ahead of
        the step] in hybrid/zero/offload/nvme/tiles.py)."""
        return self.states.prefetch()

    # -- the speculative update ([Note: what starts before the step] in host_step.py) ---
    def speculative_scalars(self, coefficient: torch.Tensor) -> torch.Tensor:
        """The ``scalars`` :meth:`begin_step` will return if the step is taken with
        gradient coefficient ``coefficient`` (fp64, 0-dim) and not skipped: the same
        fp64 values, computed without counting the step."""
        dev = self._step.device
        return torch.stack([coefficient.reshape(()).to(device=dev, dtype=torch.float64),
                            self._step + 1.0, torch.zeros((), dtype=torch.float64, device=dev)])

    def speculate(self, count: int, lr: float, scalars: torch.Tensor,
                  outs: list[torch.Tensor], stop: Callable[[], bool] | None = None) -> int:
        """Update the first ``count`` tiles the states read ahead, held in their staging
        buffers (:meth:`SwappedStates.ahead`), with ``lr`` and ``scalars``; their new
        parameters go to ``outs[j]`` (one per held tile, the parameters' dtype), not to
        where the step puts them. Nothing is written to disk: the next
        :meth:`chunk_steps` uses them if its ``lr`` and ``scalars`` are these, bit for bit,
        and discards them otherwise, as :meth:`drop_speculation` does. The gradients of
        those tiles must be final on disk. ``stop()``, asked before each tile: True
        discards what is done and ends (the step is known not to match). Returns the
        tiles updated and held."""
        assert self._spec is None, "a speculation is already held"
        n = self.states.ahead(count)
        found = torch.zeros(1, dtype=torch.float32)
        c = self.cfg
        tiles: list[int] = []
        try:
            for j in range(n):
                if stop is not None and stop():  # (the step comes next: re-read j tiles)
                    self.speculation["speculated"] += j
                    self.speculation["discarded"] += j
                    self.states.release(dirty=j)
                    return 0
                t = self.states.held(j)
                assert t.grad is not None  # (held tiles come with their gradients)
                adam_step(t.master, t.grad, t.exp_avg, t.exp_avg_sq, outs[j][: t.master.numel()],
                          self._segments(t.k), lr=lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                          weight_decay=c.weight_decay, step=1, scalars=scalars,
                          found_inf=found)
                tiles.append(t.k)
        except BaseException:
            self.states.release()
            raise
        self._spec = _Speculation(tiles, lr, scalars, outs, found)
        self.speculation["speculated"] += len(tiles)
        return len(tiles)

    def drop_speculation(self) -> None:
        """Discard the held speculative update, if any, and the held tiles (no step of
        these gradients follows: a skipped one, or none): the file still holds the
        states before it; the next step reads those tiles again."""
        if self._spec is not None:
            self.speculation["discarded"] += len(self._spec.tiles)
            self._spec = None
        if self.states.holding:
            self.states.release()

    def chunk_steps(self, grad: torch.Tensor | None, lr: float, scalars: torch.Tensor,
                    found: torch.Tensor, order: Iterable[int] | None = None
                    ) -> Generator[_TileStep | _DoneStep, None, None]:
        """Every tile of ``order`` as it arrives from disk, ready to step
        (:class:`~hybrid.zero.offload.contracts.ChunkStep`); a tile goes back to disk
        when the next is asked for, and all are written when the iteration ends. A held
        speculative update (:meth:`speculate`) is used when this step's ``lr`` and
        ``scalars`` are its own bit for bit (its tiles' steps then only deliver its
        parameters), and discarded otherwise: the same bits either way."""
        order = list(range(self.states.tiles)) if order is None else list(order)
        spec, done, self._spec = self._spec, {}, None
        ahead = self.states.read_ahead  # (held tiles are its first)
        ours = order[: len(ahead)] == ahead  # else its buffers are not this loop's
        if (spec is not None and ours and lr == spec.lr
                and torch.equal(scalars.view(torch.int64), spec.scalars.view(torch.int64))):
            self.speculation["used"] += len(spec.tiles)
            done = {k: j for j, k in enumerate(spec.tiles)}
        elif spec is not None or (self.states.holding and not ours):
            if spec is not None:
                self.speculation["discarded"] += len(spec.tiles)
            # (only the updated tiles are read again; the gradients read stay)
            self.states.release(dirty=len(spec.tiles) if spec is not None and ours else None)
        for tile in self.states.each(order):
            if tile.k in done:
                assert spec is not None  # (done comes from it)
                yield _DoneStep(tile.k, spec.outs[done[tile.k]][: tile.master.numel()],
                                spec.found, found)
            elif tile.grad is None:
                assert grad is not None  # (gradients not swapped with the tiles: the flat one)
                lo, hi = self.states.bounds(tile.k)
                yield _TileStep(self, tile, grad[lo:hi], lr, scalars, found)
            else:
                yield _TileStep(self, tile, tile.grad, lr, scalars, found)

    def master_into(self, out: torch.Tensor) -> None:
        for lo, hi in self.chunks():
            out[lo:hi].copy_(self.master_range(lo, hi))

    def master_range(self, lo: int, hi: int) -> torch.Tensor:
        return self.states.read_range("master", lo, hi)

    def piece_range(self, part: int, where: slice) -> tuple[int, int]:
        """The shard elements ``[lo, hi)`` of elements ``where`` of part ``part``: where
        :attr:`states` keeps them."""
        lo = self.offsets[part] + where.start
        return lo, lo + where.stop - where.start

    def read_piece(self, key: str, part: int, where: slice) -> torch.Tensor:
        lo = self.offsets[part] + where.start
        return self.states.read_range(key, lo, lo + where.stop - where.start)

    def write_piece(self, key: str, part: int, where: slice,
                    values: torch.Tensor | None) -> None:
        lo = self.offsets[part] + where.start
        n = where.stop - where.start
        self.states.write_range(key, lo, lo + n,
                                torch.zeros(n) if values is None else values.reshape(-1))


class _TileStep:
    """Chunk ``tile.k`` of a :class:`SwappedAdamW` step: one tile, its states staged."""

    __slots__ = ("opt", "tile", "grad", "lr", "scalars", "found")

    def __init__(self, opt: SwappedAdamW, tile: Tile, grad: torch.Tensor, lr: float,
                 scalars: torch.Tensor, found: torch.Tensor):
        self.opt, self.tile, self.grad, self.lr = opt, tile, grad, lr
        self.scalars, self.found = scalars, found

    @property
    def k(self) -> int:
        return self.tile.k

    def apply(self, out: torch.Tensor | None) -> None:
        c, t = self.opt.cfg, self.tile
        adam_step(t.master, self.grad, t.exp_avg, t.exp_avg_sq, out, self.opt._segments(t.k),
                  lr=self.lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                  weight_decay=c.weight_decay, step=1, scalars=self.scalars,
                  found_inf=self.found)


@dataclass
class _Speculation:
    """A held speculative update: its tiles (the read-ahead's first), the ``lr`` and fp64
    ``scalars`` it used, the new parameters of tile ``tiles[j]`` in ``outs[j]``, and the
    non-finite flag its kernels reported into."""

    tiles: list[int]
    lr: float
    scalars: torch.Tensor
    outs: list[torch.Tensor]
    found: torch.Tensor


class _DoneStep:
    """Chunk ``k`` of a step that uses the speculative update: the tile's states are
    already updated (in its staging buffer, written back as the loop goes on); applying
    it delivers the parameters the update made, and its non-finite flag."""

    __slots__ = ("k", "params", "spec_found", "found")

    def __init__(self, k: int, params: torch.Tensor, spec_found: torch.Tensor,
                 found: torch.Tensor):
        self.k, self.params, self.spec_found, self.found = k, params, spec_found, found

    def apply(self, out: torch.Tensor | None) -> None:
        if out is not None:
            out.copy_(self.params)  # (the same dtype: the kernel's bits)
        torch.maximum(self.found, self.spec_found, out=self.found)
