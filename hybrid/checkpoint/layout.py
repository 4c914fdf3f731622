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

[Note: pipeline stages, format 4]
Under pipeline parallelism each stage (a pipeline rank: with virtual stages, all of
its model chunks) is a smaller model with ZeRO units of its own, so a PP > 1 save's
``zero_layout`` holds ``pp_size`` and one entry per stage in ``stages``
(``owns_all``, ``units``, ``unsaved``) where a PP 1 save has ``owns_all`` and
``units`` at the top; ``split_dims`` covers the whole model. Rank ``(s, d, t)``
(stage, ZeRO rank, TP rank) is global rank ``(s * D + d) * T + t``, the layout's
order (PP outermost), and its file holds its stage's units as above. A name lives in
exactly one stage's files: ``unsaved`` lists the copies a stage holds but does not
write (a tied ``wte.weight`` on a last stage that is not the first, whose values are
the first stage's: :data:`FIRST_STAGE_COPIES`). Their coordinates stay in the unit
-- ZeRO shards the unit with them -- but hold no row: a row is an owned coordinate
below ``numel`` and outside those holes. Every rank of one stage has the same units;
the stages differ. A PP 1 layout reads as one stage, so everything here takes any PP
size, and a loader finds a name's pieces whichever stage wrote them.

[Note: experts over EP, format 5]
An MoE layer's experts split over the expert-parallel group (``ep_spec``) sit in ZeRO
units of their own over the expert data-parallel group (hybrid/zero/units.py, [Note:
expert units]). A save at EP > 1 writes version 5: its ``zero_layout`` adds ``ep_size``
and ``experts`` (those parameters' names), whose split dim is 0 with the EP rank as the
chunk. A stage's rank ``r = d * T + t`` (ZeRO rank ``d``, TP rank ``t``) is EDP rank
``r // EP`` of EP rank ``r % EP`` (the expert layout, hybrid/parallel/layout.py: the EP
group folds over TP), so an expert unit is sharded ``D T / EP`` ways and chunk ``k``'s
coordinate ``x`` lies in the file of the stage's rank ``(x // S) * EP + k`` (at stage 0,
rank ``k``, the EDP rank 0 of EP rank ``k``, saves its whole unit). The files of one
stage then differ in size by TP rank too.
Everything else is as above; an EP 1 save writes version 3 or 4.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NamedTuple

from hybrid.checkpoint.files import rank_paths
from hybrid.errors import CheckpointError
from hybrid.tensor_parallel.sharding import split_spec

# What a checkpoint can hold per element, in file order; ``--no-save-optim`` keeps the first.
COLUMNS = ("master", "exp_avg", "exp_avg_sq")
ELEMENT_BYTES = 4  # fp32
# Parameters a later pipeline stage may hold a copy of, by name, with the first stage's
# values (models.gpt: a tied embedding's copy on the last stage for its head): only the
# first stage saves them, so a checkpoint holds each value once.
FIRST_STAGE_COPIES = ("wte.weight",)


def describe(engine, ps) -> dict:
    """This rank's unit layout, as metadata.json stores it (JSON-safe), read off the
    engine's own units (``engine.units``, in the order their owned ranges are saved):
    at PP > 1 its stage's, with ``unsaved`` (the names of :data:`FIRST_STAGE_COPIES`
    it holds on a stage after the first) beside them.

    CheckpointError when a unit's owned range is not the one :class:`SavedLayout`
    derives from ``(numel, dp_size, owns_all)``: a change in how hybrid.zero shards
    that this format does not describe, caught at save time rather than as wrong
    values at load time.
    """
    names = {id(p): n for n, p in engine.model.named_parameters()}
    # ZeRO's group is DP x CP (hybrid.zero.engine): its rank z is global rank z * tp +
    # tp_rank, so "dp" below (and in the files) is that group, and a checkpoint saved at
    # one CP size reads at another like a change of DP size. An expert unit's group is
    # the expert DP group ([Note: experts over EP, format 5]).
    zero = ps.dp_cp_group
    units, dp = engine.units, zero.size
    # Stage 0 units own everything; with one DP rank both readings coincide.
    owns_all = dp > 1 and bool(units) and all(u.own_hi - u.own_lo == u.padded for u in units)
    for u in units:
        n, rank = u.dp.size, u.dp.rank
        s = -(-u.numel // n)
        want = (0, u.padded) if owns_all else (rank * s, (rank + 1) * s)
        if u.padded != s * n or (u.own_lo, u.own_hi) != want:
            raise CheckpointError(f"ZeRO unit {u.name!r} owns [{u.own_lo}, {u.own_hi}) of "
                                  f"{u.padded} on ZeRO rank {rank}; the checkpoint "
                                  f"format expects [{want[0]}, {want[1]})")
    out = {"tp_size": ps.tp_size, "dp_size": dp, "owns_all": owns_all,
           "split_dims": {n: _split_dim(p) for n, p in engine.model.named_parameters()},
           "units": [[[names[id(p)], p.numel()] for p in u.params] for u in units]}
    if ps.experts_split:
        out["ep_size"] = ps.ep_size
        out["experts"] = [n for n, p in engine.model.named_parameters()
                          if getattr(p, "ep_spec", None) is not None]
        if ps.etp_size > 1:  # [Note: experts under ETP]: the rows each is seen as
            out["etp_size"] = ps.etp_size
            out["expert_rows"] = {n: p.ep_spec.inner[0] for n, p in
                                  engine.model.named_parameters()
                                  if getattr(p, "ep_spec", None) is not None}
    if ps.pp_size > 1:
        out["unsaved"] = unsaved_names(engine.model, ps.pp_rank)
    return out


def unsaved_names(model, pp_rank: int) -> list[str]:
    """The parameters of pipeline stage ``pp_rank``'s ``model`` that its save leaves to
    the first stage (:data:`FIRST_STAGE_COPIES` on any later stage)."""
    if pp_rank == 0:
        return []
    return [n for n, _ in model.named_parameters() if n in FIRST_STAGE_COPIES]


def pipeline_layout(stages: list[dict], columns: list[str]) -> dict:
    """The ``zero_layout`` of a PP > 1 save from each stage's :func:`describe` (stage
    order): the sizes, the whole model's split dims, the columns, and per stage its
    ``owns_all``, ``units`` and ``unsaved``."""
    split_dims: dict = {}
    for st in stages:
        for n, d in st["split_dims"].items():
            split_dims.setdefault(n, d)
    out = {"tp_size": stages[0]["tp_size"], "dp_size": stages[0]["dp_size"],
           "pp_size": len(stages), "columns": list(columns), "split_dims": split_dims,
           "stages": [{"owns_all": st["owns_all"], "units": st["units"],
                       "unsaved": st.get("unsaved", [])} for st in stages]}
    if "ep_size" in stages[0]:
        out["ep_size"] = stages[0]["ep_size"]
        out["experts"] = [n for st in stages for n in st["experts"]]
        if "etp_size" in stages[0]:
            out["etp_size"] = stages[0]["etp_size"]
            out["expert_rows"] = {n: r for st in stages for n, r in st["expert_rows"].items()}
    return out


def single_file_layout(shapes: dict[str, list[int]]) -> dict:
    """The layout of a one-rank checkpoint of replicated full tensors (the HF import)."""
    numel = {n: _prod(s) for n, s in shapes.items()}
    return {"tp_size": 1, "dp_size": 1, "owns_all": True, "columns": list(COLUMNS),
            "split_dims": {n: None for n in shapes},
            "units": [[[n, numel[n]] for n in shapes]]}


def _split_dim(p) -> int | None:
    spec = split_spec(p)  # (a TP split, or experts over EP)
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


def rank_of(tp_rank: int, dp_rank: int, tp_size: int, stage: int = 0, dp_size: int = 1) -> int:
    """Global rank of (tp_rank, ZeRO rank ``dp_rank``) in pipeline stage ``stage``
    (``dp_size`` ZeRO ranks per stage): Megatron's order, PP outermost, as in
    hybrid.parallel.layout."""
    return (stage * dp_size + dp_rank) * tp_size + tp_rank


class SavedLayout:
    """The old layout of checkpoint ``ckpt`` (from its metadata), for planning reads:
    any pipeline size (a PP 1 layout is one stage; see the Note on stages)."""

    def __init__(self, meta: dict, ckpt: str):
        self.ckpt = ckpt
        where = os.path.join(ckpt, "metadata.json")
        z = meta.get("zero_layout")
        if not isinstance(z, dict):
            raise CheckpointError(f"{where}: has no zero_layout; not a checkpoint of this format")
        self.tp, self.dp = z["tp_size"], z["dp_size"]
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
        # [Note: experts over EP, format 5]
        self.ep: int = z.get("ep_size", 1)
        self.experts: frozenset[str] = frozenset(z.get("experts", ()))
        # [Note: experts under ETP]: each expert row block cut into ETP column chunks,
        # the rows each expert tensor is seen as
        self.etp: int = z.get("etp_size", 1)
        self.expert_rows: dict[str, int] = z.get("expert_rows", {})
        self.full_shapes: dict[str, list[int]] = meta["model"]
        stages = z["stages"] if "stages" in z else [{"owns_all": z["owns_all"],
                                                     "units": z["units"]}]
        self.pp = len(stages)
        if z.get("pp_size", 1) != self.pp:
            raise CheckpointError(f"{where}: zero_layout says pp_size {z.get('pp_size')} and "
                                  f"describes {self.pp} stages")
        self.stage_owns_all = [bool(st["owns_all"]) for st in stages]
        self.stage_units: list[list[int]] = []  # stage -> its units (global indices)
        self.unit_stage: list[int] = []
        self.unit_numel: list[int] = []
        self._holes: dict[int, list[tuple[int, int]]] = {}  # unit -> unsaved coordinates
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (unit, offset, numel)
        self.unit_experts: list[bool] = []  # sharded over the expert DP group
        for si, st in enumerate(stages):
            unsaved = set(st.get("unsaved", ()))
            self.stage_units.append([])
            for unit in st["units"]:
                ui, off = len(self.unit_numel), 0
                for name, n in unit:
                    if name in unsaved:
                        self._holes.setdefault(ui, []).append((off, off + n))
                    else:
                        self._where.setdefault(name, (ui, off, n))
                    off += n
                self.unit_numel.append(off)
                self.unit_stage.append(si)
                self.unit_experts.append(bool(unit) and unit[0][0] in self.experts)
                self.stage_units[-1].append(ui)
        self._base: dict[tuple[int, int, int], dict[int, int]] = {}  # (stage, d, t) -> ..

    @property
    def owns_all(self) -> bool:
        """DP rank 0 saved everything (ZeRO stage 0), on the first stage."""
        return self.stage_owns_all[0]

    def names(self) -> list[str]:
        """Every saved parameter once, stage by stage in unit order."""
        return list(self._where)

    def stage_of(self, name: str) -> int:
        """The pipeline stage whose files hold ``name``."""
        return self.unit_stage[self._locate(name)[0]]

    def _locate(self, name: str) -> tuple[int, int, int]:
        if name not in self._where:
            raise CheckpointError(f"{self.ckpt}: has no saved state for parameter {name!r}")
        return self._where[name]

    def local_numel(self, name: str) -> int:
        return self._locate(name)[2]

    def split_size(self, name: str) -> int:
        """Into how many chunks ``name`` was split: the EP size for an MoE layer's experts,
        the TP size otherwise (a replicated parameter's chunks are its TP replicas)."""
        return self.ep if name in self.experts else self.tp

    def _group(self, ui: int, d: int, t: int) -> tuple[int, int]:
        """(size, rank of the stage's rank (ZeRO rank ``d``, TP rank ``t``)) of the group
        unit ``ui`` is sharded over: DP x CP, or for experts the expert DP group, which
        folds over TP ([Note: experts over EP, format 5])."""
        if not self.unit_experts[ui]:
            return self.dp, d
        chunks = self.ep * self.etp
        return self.dp * self.tp // chunks, (d * self.tp + t) // chunks

    def _shard(self, ui: int) -> int:
        return -(-self.unit_numel[ui] // self._group(ui, 0, 0)[0])

    def _owned(self, ui: int, d: int, t: int = 0) -> tuple[int, int]:
        """Unit coordinates of unit ``ui`` that the file of ZeRO rank ``d``, TP rank ``t``
        holds (padding excluded)."""
        n = self.unit_numel[ui]
        rank = self._group(ui, d, t)[1]
        if self.stage_owns_all[self.unit_stage[ui]]:
            return (0, n) if rank == 0 else (0, 0)
        s = self._shard(ui)
        return min(rank * s, n), min((rank + 1) * s, n)

    def _saved_between(self, ui: int, a: int, b: int) -> int:
        """Rows among unit coordinates ``[a, b)`` of unit ``ui``: those outside its holes."""
        out = b - a
        for x, y in self._holes.get(ui, ()):
            out -= max(0, min(b, y) - max(a, x))
        return out

    def _bases(self, d: int, stage: int, t: int = 0) -> dict[int, int]:
        """Start row of every unit of ``stage`` in the data file of ZeRO rank ``d``, TP
        rank ``t`` (the same for every TP rank without experts), and under key -1 the
        total rows."""
        t = t if self.experts else 0
        key = (stage, d, t)
        if key not in self._base:
            rows, out = 0, {}
            for ui in self.stage_units[stage]:
                out[ui] = rows
                rows += self._saved_between(ui, *self._owned(ui, d, t))
            out[-1] = rows
            self._base[key] = out
        return self._base[key]

    @property
    def weights_only(self) -> bool:
        """Saved with ``--no-save-optim``: the master column and no optimizer state."""
        return self.columns == ("master",)

    def rows(self, d: int, stage: int = 0, t: int = 0) -> int:
        """Elements per column in the data file of the rank of ``stage`` with ZeRO rank
        ``d`` and TP rank ``t``."""
        return self._bases(d, stage, t)[-1]

    def data_bytes(self, d: int, stage: int = 0, t: int = 0) -> int:
        """Size the data file of the rank of ``stage`` with ZeRO rank ``d`` and TP rank
        ``t`` must have."""
        return self.rows(d, stage, t) * ELEMENT_BYTES * len(self.columns)

    def data_path(self, t: int, d: int, stage: int = 0) -> str:
        return rank_paths(self.ckpt, rank_of(t, d, self.tp, stage, self.dp))[1]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, DP rank, TP rank) of old global rank ``rank``."""
        z, t = divmod(rank, self.tp)
        stage, d = divmod(z, self.dp)
        return stage, d, t

    def reads(self, name: str, t: int, a: int, b: int, cols) -> Iterator[Read]:
        """The :class:`Read` s of columns ``cols`` (indices into :attr:`columns`, one plane
        each, in that order) of elements ``[a, b)`` of TP rank ``t``'s local ``name``
        flattened, in order, from the files of the stage that saved ``name``: per DP
        shard crossed, one exact read per column (format 3 and 4), or one read of the
        whole interleaved rows with the columns picked out of it (format 2). A format-2
        weights-only load therefore reads the moments too: 12 bytes per master value
        instead of 4, 3x the bytes in as many reads (and a buffer of 3x the range), the
        price of interleaving that format 3 removed."""
        ui, off, n = self._locate(name)
        if not 0 <= a <= b <= n:
            raise CheckpointError(f"{self.ckpt}: range [{a}, {b}) is outside {name!r} "
                                  f"({n} elements per TP rank)")
        stage = self.unit_stage[ui]
        owns_all = self.stage_owns_all[stage]
        x, y = off + a, off + b
        s = self._shard(ui)
        # experts: ``t`` is the old chunk (EP rank x ETP + ETP rank), whose shards are
        # the stage's ranks (x // s) * EP * ETP + t (ZeRO rank d, TP rank tt: d * TP +
        # tt); else the TP rank, over the ZeRO ranks x // s
        experts = self.unit_experts[ui]
        while x < y:
            shard = 0 if owns_all else x // s
            d, tt = (divmod(shard * self.ep * self.etp + t, self.tp) if experts
                     else (shard, t))
            end = y if owns_all else min(y, (shard + 1) * s)
            # (a saved name lies outside the holes, so its rows are contiguous)
            lo = self._owned(ui, d, tt)[0]
            row = self._bases(d, stage, tt)[ui] + self._saved_between(ui, lo, x)
            m, k = end - x, x - off - a
            path, size = self.data_path(tt, d, stage), self.data_bytes(d, stage, tt)
            if self.interleaved:  # column c of row r: element w * r + c
                w = len(self.columns)
                yield Read(path, size, row * w * ELEMENT_BYTES, m * w, k, m,
                           [(p, c, w) for p, c in enumerate(cols)])
            else:  # column c of row r: element c * rows(d) + r
                rows = self.rows(d, stage, tt)
                for p, c in enumerate(cols):
                    yield Read(path, size, (c * rows + row) * ELEMENT_BYTES, m, k, m,
                               [(p, 0, 1)])
            x = end
