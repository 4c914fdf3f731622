"""Read any TP-local range of a parameter, in any new TP layout, from the old files.

``ParamSource.read(name, target, lo, hi)`` returns elements ``[lo, hi)`` of the
new TP-local parameter flattened, as a ``(len(keys), hi - lo)`` fp32 tensor: one
plane per saved value asked for (``master``, ``exp_avg``, ``exp_avg_sq``; a
weights-only load asks for ``master`` alone), reading only the old ranges that
hold them, and of those only the asked-for column blocks (of a format-2 file,
the whole interleaved rows). The tools (convert, HF export, generate) ask for
"TP size 1, ``[0, numel)``": one full parameter at a time.

[Note: TP remapping as rectangles]
View a parameter as a matrix of ``rows = prod(full_shape[:dim])`` by ``cols =
prod(full_shape[dim:])``; a TP split along ``dim`` cuts the columns into ``T``
chunks of width ``W = cols / T``, and TP rank ``t``'s local tensor flattened is
its chunk row-major (a split along dim 0 is one row; a replicated parameter is
one chunk, ``T = 1``). A new-local range is at most three rectangles (partial
first row, full middle rows, partial last row). Each rectangle's columns are
cut at the old chunk boundaries; each piece is an old-local rectangle, read as
one contiguous old-local span when it is one row, full width, or at least half
the width (so at most 2x the needed bytes), else one read per row (exact).
Spans are then cut at the old DP shard boundaries into file reads
(:mod:`hybrid.checkpoint.layout`). When old and new split the parameter the
same way, the old-local range *is* the new-local one: one span, exact.

[Note: experts as blocks]
An MoE layer's experts split over EP (``ep_spec``) and under ETP also over their hidden
units are read by a path of their own (:meth:`ParamSource._read_experts`): the tensor
seen as R rows (``E`` at ETP 1; ``E x parts`` of ``fc``, ``E x hidden`` of ``proj``
under ETP, as the save records), each rank's piece a block of EP rows cut into ETP
column chunks, the old piece ``(b, c)`` the chunk ``b x ETP + c`` (which files hold it:
:mod:`hybrid.checkpoint.layout`, [Note: experts over EP, format 5]). Any EP x ETP reads
any other, and a checkpoint of every expert on every rank (EP 1) reads as one piece.

The padded vocabulary (``wte.weight`` and an untied ``output_layer.weight``,
split along dim 0, so one row) may differ between TP sizes: new columns past
the old full size are zero, and old ones past the new size are not read (rows
past the real vocabulary are zero in both).

Fused parameters whose TP slice interleaves parts -- SwiGLU's ``[gate; up]``,
where a rank holds its gate rows and then its up rows -- are saved with the
full shape that makes the slice a column chunk (``(2, F, C)`` split along dim
1: two rows of ``F C / T``-wide chunks), so they reshard as rectangles like
any other. The grouped QKV needs nothing special: its rows are whole query
groups, a contiguous chunk along dim 0 at every TP size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybrid.checkpoint.files import read_metadata
from hybrid.checkpoint.integrity import Integrity
from hybrid.checkpoint.layout import COLUMNS, SavedLayout
from hybrid.checkpoint.reader import RangeReader
from hybrid.errors import CheckpointError
from hybrid.tensor_parallel.sharding import split_spec

KEYS = COLUMNS


class Target:
    """How the reading rank holds a parameter: chunk ``rank`` of ``size`` along ``dim``
    of ``full_shape`` (``dim`` None: replicated; ``rank`` then only spreads reads
    over the old replicas)."""

    __slots__ = ("full_shape", "dim", "rank", "size", "inner", "expert")

    def __init__(self, full_shape, dim: int | None, rank: int, size: int,
                 inner: tuple[int, int, int] | None = None, expert: bool = False):
        self.full_shape, self.dim, self.rank, self.size = tuple(full_shape), dim, rank, size
        self.inner, self.expert = inner, expert  # (experts: ShardSpec.inner, ep_spec)

    @classmethod
    def of(cls, param, tp_rank: int) -> Target:
        spec = split_spec(param)  # (a TP split, or an MoE layer's experts over EP / ETP)
        if spec is None:
            return cls(param.shape, None, tp_rank, 1)
        return cls(spec.full_shape, spec.dim, spec.rank, spec.size, spec.inner,
                   getattr(param, "ep_spec", None) is not None)


class _Geometry(NamedTuple):
    old_cols: int
    old_width: int  # old chunk width (old_cols when replicated)
    old_split: bool
    new_width: int
    new_col0: int  # first full column of the new chunk
    replica: int  # the old TP rank read for a replicated parameter


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def rectangles(lo: int, hi: int, width: int):
    """``(row0, row1, col0, col1)``: at most 3 rectangles of a width-``width`` row-major
    matrix covering flat range ``[lo, hi)`` in order, each contiguous in it."""
    r0, c0 = divmod(lo, width)
    r1, c1 = divmod(hi, width)
    if r0 == r1:
        yield r0, r0 + 1, c0, c1
        return
    if c0:
        yield r0, r0 + 1, c0, width
        r0 += 1
    if r1 > r0:
        yield r0, r1, 0, width
    if c1:
        yield r1, r1 + 1, 0, c1


class ParamSource:
    """Reads of a saved checkpoint's parameter state through one :class:`RangeReader`.

    ``keys``: the saved values to read, in the order of the returned planes;
    CheckpointError when the checkpoint does not hold one of them (a weights-only
    checkpoint has no moments).
    """

    def __init__(self, layout: SavedLayout, reader: RangeReader, keys=KEYS):
        missing = [k for k in keys if k not in layout.columns]
        if missing:
            raise CheckpointError(f"{layout.ckpt}: holds only {', '.join(layout.columns)} "
                                  f"(saved with --no-save-optim), not {', '.join(missing)}")
        self.layout, self.reader = layout, reader
        self.cols = [layout.columns.index(k) for k in keys]

    def read(self, name: str, target: Target, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``name`` as ``target`` holds it: ``(len(keys), hi - lo)``."""
        if target.expert or name in self.layout.experts:
            return self._read_experts(name, target, lo, hi)
        g = self._geometry(name, target)
        k = len(self.cols)
        if (g.old_split == (target.dim is not None) and g.old_width == g.new_width
                and g.old_cols == g.new_width * (target.size if g.old_split else 1)):
            # Split the same way (or replicated in both): the old-local range is this one.
            out = torch.empty(k, hi - lo)
            self._read_span(name, target.rank if g.old_split else g.replica, lo, hi, out)
            return out
        out = torch.zeros(k, hi - lo)  # columns past the old full size stay zero
        for r0, r1, c0, c1 in rectangles(lo, hi, g.new_width):
            start = r0 * g.new_width + c0 - lo
            dst = out[:, start: start + (r1 - r0) * (c1 - c0)].view(k, r1 - r0, c1 - c0)
            a, b = g.new_col0 + c0, min(g.new_col0 + c1, g.old_cols)
            col = a
            while col < b:  # cut at the old chunk boundaries
                t = col // g.old_width if g.old_split else g.replica
                t_lo = t * g.old_width if g.old_split else 0
                end = min(b, t_lo + g.old_width)
                self._read_rect(name, t, r0, r1, col - t_lo, end - t_lo, g.old_width,
                                dst[:, :, col - a: end - a])
                col = end
        return out

    def _read_experts(self, name: str, target: Target, lo: int, hi: int) -> torch.Tensor:
        """:meth:`read` of an MoE layer's experts ([Note: experts as blocks]): old and new
        each a grid of row blocks (EP) by column chunks (ETP) of the tensor seen as R
        rows; the new local range's rectangles cut at the old grid's lines."""
        lay = self.layout
        old_shape = lay.full_shapes.get(name)
        if old_shape is None:
            raise CheckpointError(f"{lay.ckpt}: has no parameter {name!r}")
        numel = _prod(target.full_shape)
        rows = (target.inner[0] if target.inner is not None
                else lay.expert_rows.get(name, target.full_shape[0]))
        saved = name in lay.experts
        old_blocks, old_chunks = (lay.ep, lay.etp if name in lay.expert_rows else 1) \
            if saved else (1, 1)
        new_blocks = target.size if target.expert else 1
        new_chunks, new_c = (target.inner[2], target.inner[1]) if target.inner else (1, 0)
        cols = numel // rows
        if (_prod(old_shape) != numel or rows % old_blocks or rows % new_blocks
                or cols % old_chunks or cols % new_chunks
                or lay.local_numel(name) * old_blocks * old_chunks != numel):
            raise CheckpointError(f"{lay.ckpt}: {name!r} is {old_shape} in {old_blocks} x "
                                  f"{old_chunks} pieces there and {list(target.full_shape)} "
                                  f"in {new_blocks} x {new_chunks} here; a different model")
        k = len(self.cols)
        old_h, old_w = rows // old_blocks, cols // old_chunks
        new_h, new_w = rows // new_blocks, cols // new_chunks
        new_r = target.rank if target.expert else 0
        if (old_blocks, old_chunks) == (new_blocks, new_chunks):  # the same pieces
            out = torch.empty(k, hi - lo)
            self._read_span(name, new_r * old_chunks + new_c if saved else target.rank % lay.tp,
                            lo, hi, out)
            return out
        out = torch.empty(k, hi - lo)
        row0, col0 = new_r * new_h, new_c * new_w
        for r0, r1, c0, c1 in rectangles(lo, hi, new_w):
            start = r0 * new_w + c0 - lo
            dst = out[:, start: start + (r1 - r0) * (c1 - c0)].view(k, r1 - r0, c1 - c0)
            g = row0 + r0
            while g < row0 + r1:  # cut at the old row blocks, then the old column chunks
                b = g // old_h
                g_end = min(row0 + r1, (b + 1) * old_h)
                col = col0 + c0
                while col < col0 + c1:
                    c = col // old_w
                    end = min(col0 + c1, (c + 1) * old_w)
                    t = b * old_chunks + c if saved else target.rank % lay.tp
                    self._read_rect(name, t, g - b * old_h, g_end - b * old_h,
                                    col - c * old_w, end - c * old_w, old_w,
                                    dst[:, g - row0 - r0: g_end - row0 - r0,
                                        col - col0 - c0: end - col0 - c0])
                    col = end
                g = g_end
        return out

    def _geometry(self, name: str, target: Target) -> _Geometry:
        lay = self.layout
        old_dim = lay.split_dims.get(name)
        old_shape, new_shape = lay.full_shapes.get(name), list(target.full_shape)
        if old_shape is None:
            raise CheckpointError(f"{lay.ckpt}: has no parameter {name!r}")
        if old_dim is not None and target.dim is not None and old_dim != target.dim:
            raise CheckpointError(f"{lay.ckpt}: {name!r} was split along dim {old_dim}, here "
                                  f"along dim {target.dim}; a different model")
        dim = target.dim if target.dim is not None else old_dim
        rows = _prod(new_shape[:dim]) if dim is not None else 1
        old_rows = _prod(old_shape[:dim]) if dim is not None else 1
        old_t = lay.split_size(name) if old_dim is not None else 1
        old_cols, new_cols = _prod(old_shape) // old_rows, _prod(new_shape) // rows
        new_t = target.size if target.dim is not None else 1
        if (old_rows != rows or old_cols % old_t or new_cols % new_t
                or lay.local_numel(name) * old_t != old_rows * old_cols):
            raise CheckpointError(f"{lay.ckpt}: {name!r} is {old_shape} split {old_t} ways "
                                  f"there and {new_shape} split {new_t} ways here; only the "
                                  f"padded vocabulary (dim 0) may differ")
        new_width = new_cols // new_t
        return _Geometry(old_cols, old_cols // old_t, old_dim is not None, new_width,
                         (target.rank if target.dim is not None else 0) * new_width,
                         target.rank % lay.tp)

    def _read_rect(self, name, t, r0, r1, a, b, width, dst) -> None:
        """Old-local rows ``[r0, r1)`` x columns ``[a, b)`` of TP rank ``t`` (chunk width
        ``width``) into ``dst`` ``(planes, r1 - r0, b - a)``."""
        n_rows, w = r1 - r0, b - a
        k = dst.shape[0]
        if n_rows > 1 and 2 * w < width:  # narrow: one exact read per row
            tmp = torch.empty(k, w)
            for i in range(n_rows):
                x = (r0 + i) * width + a
                self._read_span(name, t, x, x + w, tmp)
                dst[:, i].copy_(tmp)
            return
        x, y = r0 * width + a, (r1 - 1) * width + b  # one covering span
        if dst.stride(2) == 1 and (n_rows == 1 or w == width == dst.stride(1)):
            # no gaps, each plane contiguous: read in place
            self._read_span(name, t, x, y, dst[:, 0] if n_rows == 1 else dst.view(k, -1))
            return
        tmp = torch.empty(k, y - x)
        self._read_span(name, t, x, y, tmp)
        dst.copy_(tmp.as_strided((k, n_rows, w), (y - x, width, 1)))

    def _read_span(self, name: str, t: int, x: int, y: int, out: torch.Tensor) -> None:
        """Old TP rank ``t``'s local elements ``[x, y)`` of ``name`` into ``out``
        ``(planes, y - x)``, each plane contiguous, by the positional reads the layout
        plans (:meth:`SavedLayout.reads`: one per plane and DP shard crossed, or one
        per DP shard of a format-2 file)."""
        for r in self.layout.reads(name, t, x, y, self.cols):
            if r.numel == r.n:  # one plane's run: straight into it
                self.reader.read_into(r.path, r.size, r.offset, out[r.picks[0][0], r.k: r.k + r.n])
                continue
            buf = torch.empty(r.numel)
            self.reader.read_into(r.path, r.size, r.offset, buf)
            for plane, first, step in r.picks:
                out[plane, r.k: r.k + r.n].copy_(buf[first::step])


def iter_full_params(ckpt: str, keys=None, reader: RangeReader | None = None):
    """``(metadata, iterator of (name, {key: full fp32 tensor}))`` for a checkpoint
    directory: one parameter's full tensors at a time, in saved order. ``keys``: the
    saved values to read (default: all the checkpoint holds); CheckpointError naming
    the checkpoint when it lacks one (``--no-save-optim`` saves ``master`` only)."""
    reader = reader or RangeReader()
    meta = read_metadata(ckpt, reader)
    reader.integrity = Integrity(ckpt, meta, check=reader.verify)
    layout = SavedLayout(meta, ckpt)
    keys = layout.columns if keys is None else tuple(keys)
    source = ParamSource(layout, reader, keys)

    def gen():
        try:
            for name in layout.names():
                shape = layout.full_shapes[name]
                planes = source.read(name, Target(shape, None, 0, 1), 0, _prod(shape))
                # each its own storage (torch.save would write a shared one whole)
                yield name, {k: (planes[j].clone() if len(keys) > 1 else planes[j]).view(shape)
                             for j, k in enumerate(keys)}
            reader.finish()  # blocks shared by two parameters are checked by now
        finally:
            reader.close()
    return meta, gen()


def merged_state(ckpt: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(metadata, {name: {"master", "exp_avg", "exp_avg_sq"}}) of a whole checkpoint,
    unsharded (``{"master"}`` only for a weights-only one)."""
    meta, params = iter_full_params(ckpt)
    return meta, dict(params)
