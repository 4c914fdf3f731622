"""Where every saved value lives: the ``zero_layout`` of ``metadata.json``.

``describe(engine, ps)`` (save side) writes down the ZeRO unit layout: TP and
DP sizes, whether DP rank 0 holds everything (stage 0), each parameter's TP
split dimension, and the units as lists of ``[param name, TP-local numel]``.
That is O(parameters), whatever the world size. ``SavedLayout`` (load side)
turns a (parameter, old TP rank, old TP-local range) into positional reads of
the old data files, from the metadata alone: no other rank's header is read.

[Note: a data file is its rank's owned unit ranges, column by column]
Unit ``u`` has ``numel`` elements padded to ``N * S`` (``N`` = DP size, ``S`` =
``ceil(numel / N)``); DP rank ``d`` owns unit coordinates ``[d*S, (d+1)*S)`` (at
stage 0, DP rank 0 saves ``[0, padded)`` and the others nothing). A rank's
*rows* are, unit after unit, its owned coordinates below ``numel`` (padding is
not stored). Its data file holds one fp32 block of all its rows per saved
column (``zero_layout["columns"]``: ``master, exp_avg, exp_avg_sq``, or only
``master`` for a ``--no-save-optim`` checkpoint), blocks in that order. So unit
coordinate ``x`` of unit ``u``, column ``c``, is element ``c * R(d) + base(u, d)
+ x - d*S`` of rank ``(t, d)``'s file, where ``base(u, d)`` sums what ``d`` owns of
the units before ``u`` and ``R(d)`` is all it owns. Column blocks make any row
range of one column one contiguous read: a weights-only load reads the master
bytes it needs and nothing of the moments. The unit structure is the same on
every rank (same names, same TP-local numels; the save checks it), so this
holds for every TP rank ``t``. ``base`` is built per DP rank on first use, only
for the few ``d`` a loader touches: nothing loops over the world.

[Note: format 2 still loads]
A version-2 checkpoint has the same rows, metadata and headers, but its data
file holds them interleaved, ``[master, exp_avg, exp_avg_sq]`` per row (so column
``c`` of row ``r`` is element ``3 * r + c``), and its ``zero_layout`` names no
columns (it always saved all three). :meth:`SavedLayout.reads` is the one place
that turns (column, row range) into byte ranges, for both; everything above it
(resharding, exact and weights-only loads, the tools) is format-blind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NamedTuple

from hybrid.checkpoint.files import rank_paths
from hybrid.errors import CheckpointError

# What a checkpoint can hold per element, in file order; ``--no-save-optim`` keeps the first.
COLUMNS = ("master", "exp_avg", "exp_avg_sq")
ELEMENT_BYTES = 4  # fp32


def describe(engine, ps) -> dict:
    """This rank's unit layout, as metadata.json stores it (JSON-safe), read off the
    engine's own units (``engine.units``, in the order their owned ranges are saved).

    CheckpointError when a unit's owned range is not the one :class:`SavedLayout`
    derives from ``(numel, dp_size, owns_all)``: a change in how hybrid.zero shards
    that this format does not describe, caught at save time rather than as wrong
    values at load time.
    """
    names = {id(p): n for n, p in engine.model.named_parameters()}
    # ZeRO's group is DP x CP (hybrid.zero.engine): its rank z is global rank z * tp +
    # tp_rank, so "dp" below (and in the files) is that group, and a checkpoint saved at
    # one CP size reads at another like a change of DP size
    zero = ps.dp_cp_group
    units, dp, dp_rank = engine.units, zero.size, zero.rank
    # Stage 0 units own everything; with one DP rank both readings coincide.
    owns_all = dp > 1 and bool(units) and all(u.own_hi - u.own_lo == u.padded for u in units)
    for u in units:
        s = -(-u.numel // dp)
        want = (0, u.padded) if owns_all else (dp_rank * s, (dp_rank + 1) * s)
        if u.padded != s * dp or (u.own_lo, u.own_hi) != want:
            raise CheckpointError(f"ZeRO unit {u.name!r} owns [{u.own_lo}, {u.own_hi}) of "
                                  f"{u.padded} on ZeRO rank {dp_rank}; the checkpoint "
                                  f"format expects [{want[0]}, {want[1]})")
    return {"tp_size": ps.tp_size, "dp_size": dp, "owns_all": owns_all,
            "split_dims": {n: _split_dim(p) for n, p in engine.model.named_parameters()},
            "units": [[[names[id(p)], p.numel()] for p in u.params] for u in units]}


def single_file_layout(shapes: dict[str, list[int]]) -> dict:
    """The layout of a one-rank checkpoint of replicated full tensors (the HF import)."""
    numel = {n: _prod(s) for n, s in shapes.items()}
    return {"tp_size": 1, "dp_size": 1, "owns_all": True, "columns": list(COLUMNS),
            "split_dims": {n: None for n in shapes},
            "units": [[[n, numel[n]] for n in shapes]]}


def _split_dim(p) -> int | None:
    spec = getattr(p, "tp_spec", None)
    return None if spec is None else spec.dim


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


class Read(NamedTuple):
    """One positional read: ``numel`` fp32 elements of ``path`` (``size`` bytes long) from
    byte ``offset``. For each ``(plane, first, step)`` of ``picks``, elements ``first +
    i * step`` (``i < n``) of it are elements ``[k, k + n)`` of that plane of the range."""
    path: str
    size: int
    offset: int
    numel: int  # (not ``count``: that is a tuple's method)
    k: int
    n: int
    picks: list[tuple[int, int, int]]


def rank_of(tp_rank: int, dp_rank: int, tp_size: int) -> int:
    """Global rank of (tp_rank, dp_rank): Megatron's order, as in hybrid.parallel.state."""
    return dp_rank * tp_size + tp_rank


class SavedLayout:
    """The old layout of checkpoint ``ckpt`` (from its metadata), for planning reads."""

    def __init__(self, meta: dict, ckpt: str):
        self.ckpt = ckpt
        where = os.path.join(ckpt, "metadata.json")
        z = meta.get("zero_layout")
        if not isinstance(z, dict):
            raise CheckpointError(f"{where}: has no zero_layout; not a checkpoint of this format")
        self.tp, self.dp, self.owns_all = z["tp_size"], z["dp_size"], bool(z["owns_all"])
        # Format 2: interleaved rows, always all three columns, not named.
        self.interleaved = meta.get("version") == 2
        cols = list(COLUMNS) if self.interleaved else z.get("columns")
        if (not isinstance(cols, list) or not cols or cols[0] != "master"
                or not all(isinstance(c, str) for c in cols) or len(set(cols)) != len(cols)):
            raise CheckpointError(f"{where}: zero_layout names the columns {cols!r}; expected "
                                  f"'master' first, then the optimizer's per-element states "
                                  f"(hybrid's AdamW: {list(COLUMNS)})")
        self.columns: tuple[str, ...] = tuple(cols)
        self.split_dims: dict[str, int | None] = z["split_dims"]
        self.full_shapes: dict[str, list[int]] = meta["model"]
        self.unit_numel: list[int] = []
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (unit, offset, numel)
        for ui, unit in enumerate(z["units"]):
            off = 0
            for name, n in unit:
                self._where[name] = (ui, off, n)
                off += n
            self.unit_numel.append(off)
        self._base: dict[int, list[int]] = {}  # dp rank -> [row of each unit's start, total]

    def names(self) -> list[str]:
        return list(self._where)

    def local_numel(self, name: str) -> int:
        if name not in self._where:
            raise CheckpointError(f"{self.ckpt}: has no saved state for parameter {name!r}")
        return self._where[name][2]

    def _shard(self, ui: int) -> int:
        return -(-self.unit_numel[ui] // self.dp)

    def _owned(self, ui: int, d: int) -> tuple[int, int]:
        """Unit coordinates of unit ``ui`` that DP rank ``d``'s file holds (padding excluded)."""
        n = self.unit_numel[ui]
        if self.owns_all:
            return (0, n) if d == 0 else (0, 0)
        s = self._shard(ui)
        return min(d * s, n), min((d + 1) * s, n)

    def _bases(self, d: int) -> list[int]:
        """Start row of every unit in DP rank ``d``'s data file, then the total rows."""
        if d not in self._base:
            rows, out = 0, []
            for ui in range(len(self.unit_numel)):
                out.append(rows)
                lo, hi = self._owned(ui, d)
                rows += hi - lo
            self._base[d] = out + [rows]
        return self._base[d]

    @property
    def weights_only(self) -> bool:
        """Saved with ``--no-save-optim``: the master column and no optimizer state."""
        return self.columns == ("master",)

    def rows(self, d: int) -> int:
        """Elements per column in the data file of every rank with DP rank ``d``."""
        return self._bases(d)[-1]

    def data_bytes(self, d: int) -> int:
        """Size the data file of every rank with DP rank ``d`` must have."""
        return self.rows(d) * ELEMENT_BYTES * len(self.columns)

    def data_path(self, t: int, d: int) -> str:
        return rank_paths(self.ckpt, rank_of(t, d, self.tp))[1]

    def reads(self, name: str, t: int, a: int, b: int, cols) -> Iterator[Read]:
        """The :class:`Read` s of columns ``cols`` (indices into :attr:`columns`, one plane
        each, in that order) of elements ``[a, b)`` of TP rank ``t``'s local ``name``
        flattened, in order: per DP shard crossed, one exact read per column (format 3),
        or one read of the whole interleaved rows with the columns picked out of it
        (format 2). A format-2 weights-only load therefore reads the moments too: 12
        bytes per master value instead of 4, 3x the bytes in as many reads (and a
        buffer of 3x the range), the price of interleaving that format 3 removed."""
        ui, off, n = self._where[name]
        if not 0 <= a <= b <= n:
            raise CheckpointError(f"{self.ckpt}: range [{a}, {b}) is outside {name!r} "
                                  f"({n} elements per TP rank)")
        x, y = off + a, off + b
        s = self._shard(ui)
        while x < y:
            d = 0 if self.owns_all else x // s
            end = y if self.owns_all else min(y, (d + 1) * s)
            row, m, k = self._bases(d)[ui] + x - self._owned(ui, d)[0], end - x, x - off - a
            path, size = self.data_path(t, d), self.data_bytes(d)
            if self.interleaved:  # column c of row r: element w * r + c
                w = len(self.columns)
                yield Read(path, size, row * w * ELEMENT_BYTES, m * w, k, m,
                           [(p, c, w) for p, c in enumerate(cols)])
            else:  # column c of row r: element c * rows(d) + r
                for p, c in enumerate(cols):
                    yield Read(path, size, (c * self.rows(d) + row) * ELEMENT_BYTES, m, k, m,
                               [(p, 0, 1)])
            x = end
