"""Sharded checkpoints: atomic save, exact resume, and load into any other layout.

On disk::

    SAVE/latest                      "iter_0000100" (written last, atomically)
    SAVE/iter_0000100/metadata.json  config, iteration, consumed samples, model
                                     shapes, optimizer step, loss-scaler state, and
                                     the ``zero_layout`` (TP/DP sizes, each unit's
                                     [param name, TP-local numel] list, the saved
                                     columns): O(params), readable without torch
    SAVE/iter_0000100/rank_00003.pt  rank 3's small header: TP/DP rank, TP specs, RNG
                                     states, step, loss scale, its piece table
                                     {name: [(lo, hi, first row in the .bin)]} and
                                     the crc32 of each 64 KiB block of its .bin
    SAVE/iter_0000100/rank_00003.bin rank 3's values: its rows (each piece -- a
                                     TP-local element range [lo, hi) of one
                                     parameter -- in unit order) as one fp32 block
                                     per column: master, exp_avg, exp_avg_sq; no
                                     padding, no framing

A pipeline run (PP > 1) saves stage by stage in the same files (format 4): each
stage's ranks write that stage's pieces, ``zero_layout`` describes every stage's units
(see the Note on stages in :mod:`hybrid.checkpoint.layout`), ``model`` is the whole
model's, and a tied embedding's copy on the last stage is left to the first stage's.
A PP 1 save writes format 3 as before, plus ``pipeline_model_parallel_size`` (1) in
metadata.json and ``pp_rank`` (0) in each header.

metadata.json also holds every header's size and crc32 (``checksums``), so
every byte of a checkpoint is checked as it is loaded
(:mod:`hybrid.checkpoint.integrity`). A caller may add small whole files that
rank 0 writes beside metadata.json (``extra_files``: ``hybrid.initialize``'s
``client_state.pt``); their sizes and crc32s are listed there too.

``optimizer=False`` (``--no-save-optim``) writes the master column only (about a
third of the bytes; ``zero_layout["columns"] == ["master"]``, no step or loss
scale): every reader of weights takes it, an exact resume refuses it.

A save is written into ``SAVE/.tmp_iter_...``, flushed, and renamed into place,
then ``latest`` is replaced: a crash at any moment leaves the previous
checkpoint complete and pointed to. Errors on any rank (a full disk, a
read-only directory) are agreed on over the world, the temporary is removed,
and every rank raises the same :class:`CheckpointError`; nothing existing is
touched.

[Note: I/O proportional to what a rank owns]
A rank's data file is its owned unit ranges in order (see
:mod:`hybrid.checkpoint.layout`), so from ``zero_layout`` alone a loader knows
which rows of which old file hold any (parameter, TP-local range), without
opening anything else. Loading in the same layout reads the metadata, the
rank's header (RNG states) and its own data file, nothing more; another
layout reads only the overlapping ranges of the overlapping files
(:mod:`hybrid.checkpoint.reshard`), never a whole parameter's full tensors
unless the rank owns all of it. Column blocks make any sub-range of a piece
one contiguous read per column, so a weights-only load reads no moment bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import BinaryIO

import torch

from hybrid.checkpoint.files import (
    EXPERT_VERSION,
    LATEST,
    PIPELINE_VERSION,
    VERSION,
    complete_checkpoints,
    iter_name,
    rank_paths,
)
from hybrid.checkpoint.integrity import ALGORITHM, BLOCK_BYTES, BlockSums, crc32, header_bytes
from hybrid.checkpoint.layout import describe, pipeline_layout
from hybrid.checkpoint.ownership import write_owner
from hybrid.checkpoint.snapshot import HostSnapshot, Snapshot
from hybrid.errors import CheckpointError
from hybrid.parallel.agree import agree_error
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import TPRNGTracker
from hybrid.tensor_parallel.random import get_device_rng_state
from hybrid.tensor_parallel.sharding import split_spec
from hybrid.zero import ZeroEngine
from hybrid.zero.state import check_saveable, iter_piece_values, shard_state

# A small whole file rank 0 writes beside metadata.json: its bytes, or a function that
# writes them to a binary file (a large one, streamed: a module's frozen parameters)
ExtraFile = bytes | Callable[[BinaryIO], None]


def fsync_write(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_signature(model: torch.nn.Module) -> dict:
    """Full (unsharded) shape of every parameter, by name."""
    from hybrid.tensor_parallel import full_shape
    return {n: list(full_shape(p)) for n, p in model.named_parameters()}


def whole_model_signature(model: torch.nn.Module, ps: ParallelState) -> dict:
    """:func:`model_signature` of the whole model when ``model`` is one pipeline stage:
    the stages' signatures in stage order, a name held by two stages (a tied
    embedding's copy) once. Collective over ``ps.pp_group`` (every rank calls it); at
    PP 1 ``model``'s own, with no communication."""
    mine = model_signature(model)
    if ps.pp_size == 1:
        return mine
    out: dict = {}
    for sig in gather_json(ps.pp_group, mine, ps.device):
        for n, shape in sig.items():
            out.setdefault(n, shape)
    return out


def gather_json(group, obj, device) -> list:
    """The JSON value ``obj`` of every rank of ``group``, in group order: two all-gathers
    (the lengths, then the bytes padded to the longest), O(group x size) bytes."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = torch.zeros(group.size, dtype=torch.int64, device=device)
    group.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = int(sizes.max())
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: data.numel()] = data.to(device)
    out = torch.empty(group.size, longest, dtype=torch.uint8, device=device)
    group.all_gather(out, buf)
    rows = out.cpu()
    return [json.loads(rows[i, : int(n)].numpy().tobytes()) for i, n in enumerate(sizes.tolist())]


def save_checkpoint(save_dir: str, iteration: int, consumed_samples: int, engine: ZeroEngine,
                    ps: ParallelState, config: dict, rng: TPRNGTracker,
                    keep_last: int | None = None, vocab_size: int | None = None, *,
                    optimizer: bool = True, finetune: dict | None = None,
                    extra_meta: dict | None = None, extra_files: dict[str, ExtraFile] | None = None,
                    checksum_block_bytes: int = BLOCK_BYTES, owner: dict | None = None,
                    info: dict | None = None) -> str:
    """Write checkpoint ``iteration`` (collective over the world); return its directory.

    ``config``: the run's flat flags, recorded as metadata.json's ``config`` (what
    ``scripts/generate.py`` and the converters rebuild the model from).
    ``optimizer`` False (``--no-save-optim``): the fp32 master values only.
    ``finetune``: recorded as metadata.json's ``finetune`` (where a ``--finetune``
    run started; see :mod:`hybrid.checkpoint.resume`), None for other runs.
    ``keep_last``: afterwards keep only the newest N complete checkpoints.
    ``extra_meta``: more metadata.json entries (JSON values; ``hybrid.initialize``'s
    client state's file name and schedule). ``extra_files``: on rank 0, {file name:
    bytes}, small files written into the checkpoint directory before metadata.json
    (so a complete checkpoint has them), each one's [bytes, crc32] listed in
    metadata.json's ``checksums["files"]``; ignored on other ranks.
    ``checksum_block_bytes``: the data files' checksum block (tests make it small to
    see partial blocks on tiny models). ``owner``: on
    rank 0, the run's claim record (:mod:`hybrid.checkpoint.ownership`), written as
    ``save_dir``'s owner before anything else. ``info``: pass a dict to receive
    ``checksum_seconds``, this rank's time spent hashing what it wrote.

    The three phases, apart for :class:`hybrid.checkpoint.async_save.AsyncSaver`:
    :func:`prepare_save` (collective), :meth:`PendingSave.write` (this rank's files,
    no collective) and :func:`finish_save` (collective).
    """
    pending = prepare_save(save_dir, iteration, consumed_samples, engine, ps, config, rng,
                           keep_last, vocab_size, optimizer=optimizer, finetune=finetune,
                           extra_meta=extra_meta, extra_files=extra_files,
                           checksum_block_bytes=checksum_block_bytes, owner=owner)
    pending.write()
    if info is not None:
        info["checksum_seconds"] = pending.sums.seconds
    return finish_save(pending, ps)


class PendingSave:
    """A save between :func:`prepare_save` and :func:`finish_save`: this rank's header
    and what its data file holds, either read from the engine as written (``values``
    None: a synchronous save, one piece in memory at a time) or a snapshot taken in
    :func:`prepare_save` (``values``: per column, each piece's fp32 CPU rows, which the
    step may go on from). :meth:`write` runs no collective, so a thread may run it."""

    def __init__(self, save_dir: str, name: str, tmp: str, final: str, header: dict,
                 columns: tuple, engine: ZeroEngine, unsaved: set[str], block_bytes: int,
                 meta: dict | None, files: dict[str, ExtraFile], keep_last: int | None,
                 values: list[Iterable[torch.Tensor]] | None):
        self.save_dir, self.name, self.tmp, self.final = save_dir, name, tmp, final
        self.header, self.columns, self.engine, self.unsaved = header, columns, engine, unsaved
        self.meta, self.files, self.keep_last, self.values = meta, files, keep_last, values
        self.sums = BlockSums(block_bytes)
        self.error: str | None = None
        self.digest = [0, 0]

    def _column_values(self, c: int) -> Iterable[torch.Tensor]:
        if self.values is not None:
            return self.values[c]
        return iter_piece_values(self.engine, (self.columns[c],), skip=self.unsaved)

    def write(self) -> None:
        """This rank's data file (column block by column block, hashed as written) and
        header (with the data's block checksums); a failure is kept in ``error``."""
        rank = self.header["rank"]
        head_path, data_path = rank_paths(self.tmp, rank)
        sums = self.sums

        def write_data(f):
            if self.header["data_rows"]:
                for c in range(len(self.columns)):
                    sums.column()
                    for values in self._column_values(c):
                        # (numpy's stubs give an ndarray its buffer on Python >= 3.12 only)
                        view = memoryview(values.numpy()).cast("B")  # type: ignore[arg-type]
                        sums.update(view)
                        f.write(view)

        path = data_path
        try:
            fsync_write(data_path, write_data)
            path = head_path
            self.header["checksums"] = sums.table()
            data = header_bytes(self.header)
            self.digest = [len(data), crc32(data)]
            fsync_write(head_path, lambda f: f.write(data))
        except (OSError, RuntimeError) as e:
            self.error = f"--save {self.save_dir}: writing {path} failed on rank {rank} ({e})"
        self.values = None  # (the snapshot's memory goes once written)


def prepare_save(save_dir: str, iteration: int, consumed_samples: int, engine: ZeroEngine,
                 ps: ParallelState, config: dict, rng: TPRNGTracker,
                 keep_last: int | None = None, vocab_size: int | None = None, *,
                 optimizer: bool = True, finetune: dict | None = None,
                 extra_meta: dict | None = None, extra_files: dict[str, ExtraFile] | None = None,
                 checksum_block_bytes: int = BLOCK_BYTES, owner: dict | None = None,
                 snapshot: bool | Snapshot = False) -> PendingSave:
    """The collective first phase of :func:`save_checkpoint` (same arguments): the
    temporary directory, the layouts checked and gathered, this rank's header (RNG
    states, step, piece table) and, on rank 0, metadata.json's content. ``snapshot``:
    copy this rank's saved values into host memory now, so the caller may go on
    training while :meth:`PendingSave.write` runs (a :class:`~hybrid.checkpoint.snapshot.
    Snapshot`: the one the saver keeps, its memory or disk space reused from save to save)."""
    if optimizer:
        check_saveable(engine)
    columns = tuple(engine.optimizer.columns) if optimizer else ("master",)
    name = iter_name(iteration)
    final, tmp = os.path.join(save_dir, name), os.path.join(save_dir, f".tmp_{name}")
    _raise_agreed(ps, _make_tmp(save_dir, tmp, owner) if ps.rank == 0 else None)
    mine = _checked_layout(save_dir, tmp, engine, ps)
    layout, signature = _whole_layout(engine, ps, mine, columns)
    state = shard_state(engine)
    if not optimizer:  # nothing of the optimizer is saved, its step and scale neither
        state["step"] = state["loss_scaler"] = None
    header, unsaved = _rank_header(engine, ps, rng, state, mine)
    values = None
    if snapshot:
        taker = snapshot if not isinstance(snapshot, bool) else HostSnapshot()
        values = taker.take(engine, columns, unsaved, header["data_rows"])
    meta = None
    if ps.rank == 0:
        meta = {"version": format_version(ps),
                "iteration": iteration, "consumed_samples": consumed_samples,
                "world_size": ps.world_size, "tensor_model_parallel_size": ps.tp_size,
                "data_parallel_size": ps.dp_size, "context_parallel_size": ps.cp_size,
                "pipeline_model_parallel_size": ps.pp_size, "zero_stage": engine.plan.stage,
                "vocab_size": vocab_size, "model": signature,
                "step": state["step"], "loss_scaler": state["loss_scaler"],
                "zero_layout": layout, "finetune": finetune, "config": config,
                **(extra_meta or {}), "complete": True}
    return PendingSave(save_dir, name, tmp, final, header, columns, engine, unsaved,
                       checksum_block_bytes, meta, dict(extra_files or {}), keep_last, values)


def finish_save(pending: PendingSave, ps: ParallelState) -> str:
    """The collective last phase: every rank's write agreed on (a failure anywhere: the
    temporary removed, the same CheckpointError everywhere), the headers' sizes and
    crc32s gathered, rank 0's metadata.json written and the checkpoint published as
    ``latest``; then the pruning. Returns the checkpoint's directory."""
    _raise_agreed(ps, pending.error, pending.tmp)
    headers = _gather_header_digests(ps, pending.digest)
    error = None
    if ps.rank == 0:
        assert pending.meta is not None  # (rank 0 made it)
        meta = dict(pending.meta, checksums={"algorithm": ALGORITHM, "headers": headers})
        error = _finish(pending.save_dir, pending.name, pending.tmp, pending.final, meta,
                        pending.files)
    _raise_agreed(ps, error)
    if ps.rank == 0 and pending.keep_last:
        _prune(pending.save_dir, pending.keep_last, keep=pending.name)
    return pending.final


def _raise_agreed(ps: ParallelState, error: str | None, tmp: str | None = None) -> None:
    """Every rank raises the first rank's error (rank 0 removing ``tmp`` first); a
    world all-reduce even when there is none, so no rank is left in a collective."""
    error = agree_error(ps, error)
    if error:
        if tmp is not None and ps.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(error)


def _make_tmp(save_dir: str, tmp: str, owner: dict | None) -> str | None:
    """Rank 0: ``owner`` recorded, and a fresh temporary directory for the save; why
    not, or None."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        if owner is not None:
            write_owner(save_dir, owner)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    except OSError as e:
        return f"--save {save_dir}: cannot create the checkpoint directory ({e})"
    return None


def _checked_layout(save_dir: str, tmp: str, engine: ZeroEngine, ps: ParallelState) -> dict:
    """This rank's :func:`~hybrid.checkpoint.layout.describe`, checked to be the same on
    every rank of its pipeline stage (whose entry of ``zero_layout`` it becomes)."""
    layout: dict | None = None
    error = None
    try:
        layout = describe(engine, ps)
    except CheckpointError as e:
        error = f"--save {save_dir}: {e}; nothing was written"
    if layout is not None and not _same_units_everywhere(ps, layout["units"]):
        error = (f"--save {save_dir}: ranks disagree on the ZeRO unit layout (a bug in "
                 f"hybrid.zero); nothing was written")
    _raise_agreed(ps, error, tmp)
    assert layout is not None  # (else every rank raised)
    return layout


def _whole_layout(engine: ZeroEngine, ps: ParallelState, mine: dict,
                  columns: tuple) -> tuple[dict, dict]:
    """(``zero_layout``, the whole model's signature) as metadata.json records them:
    meaningful on rank 0, which writes them. At PP 1 this rank's, as before; at PP > 1
    the ranks of rank 0's pipeline (TP and ZeRO rank 0 of each stage) gather every
    stage's over their pipeline group, O(params) bytes, and the other ranks skip it."""
    if ps.pp_size == 1:
        return dict(mine, columns=list(columns)), model_signature(engine.model)
    if ps.tp_rank != 0 or ps.dp_cp_group.rank != 0:
        return {}, {}
    stages = gather_json(ps.pp_group, {"layout": mine, "model": model_signature(engine.model)},
                         ps.device)
    signature: dict = {}
    for st in stages:
        for n, shape in st["model"].items():
            signature.setdefault(n, shape)
    return pipeline_layout([st["layout"] for st in stages], list(columns)), signature


def _rank_header(engine: ZeroEngine, ps: ParallelState, rng: TPRNGTracker, state: dict,
                 layout: dict) -> tuple[dict, set[str]]:
    """(This rank's header without its data checksums, the parameters its data file
    leaves out: ``layout``'s ``unsaved`` names, and at ZeRO stage 0 the replicas no
    other rank needs)."""
    # Owning everything (stage 0), every DP (x CP) replica holds the same values: ZeRO
    # rank 0's copy is the one saved (SavedLayout reads its files for all of a unit).
    zero_rank = ps.dp_cp_group.rank  # ZeRO shards over DP x CP (hybrid.zero.engine)
    unsaved = set(layout.get("unsaved", ()))  # a later stage's tied embedding copy
    if layout["owns_all"]:  # the experts' replicas are the expert DP group's
        experts = set(layout.get("experts", ()))
        unsaved |= {n for n, _ in engine.model.named_parameters()
                    if (n in experts and ps.edp_group.rank != 0)
                    or (n not in experts and zero_rank != 0)}
    pieces = [pc for pc in state["pieces"] if pc[0] not in unsaved]
    table: dict[str, list[tuple[int, int, int]]] = {}  # name -> [(lo, hi, first row)]
    rows = 0
    for pname, lo, hi in pieces:
        table.setdefault(pname, []).append((lo, hi, rows))
        rows += hi - lo
    specs = {n: _spec_dict(p) for n, p in engine.model.named_parameters()}
    header = {"version": format_version(ps), "rank": ps.rank,
              "tp_rank": ps.tp_rank, "dp_rank": zero_rank, "pp_rank": ps.pp_rank,
              "specs": specs, "step": state["step"],
              "loss_scaler": state["loss_scaler"], "pieces": table, "data_rows": rows,
              "rng": {"device": get_device_rng_state(ps.device), "cpu": torch.get_rng_state(),
                      "tracker": rng.get_states()}}
    return header, unsaved


def _gather_header_digests(ps: ParallelState, digest: list[int]) -> dict:
    """{header file name: [bytes, crc32]} of every rank (one all-gather of two int64 per
    rank over the world; only rank 0 writes it down)."""
    out = torch.zeros(ps.world_size, 2, dtype=torch.int64, device=ps.device)
    ps.world_group.all_gather(out, torch.tensor(digest, dtype=torch.int64, device=ps.device))
    return {os.path.basename(rank_paths("", r)[0]): [int(n), int(c)]
            for r, (n, c) in enumerate(out.tolist())}


class _Summed:
    """A binary file's write side that keeps the size and crc32 of what passes through."""

    def __init__(self, f):
        self.f, self.size, self.crc = f, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc, self.size = crc32(view, self.crc), self.size + len(view)
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def write_files(tmp: str, files: Mapping[str, ExtraFile]) -> dict[str, list[int]]:
    """``files`` written into ``tmp`` (each flushed to disk); {name: [size, crc32]}.
    OSError for a name that is not a file's own."""
    sums = {}
    for file_name, data in files.items():
        if os.path.basename(file_name) != file_name or file_name == "metadata.json":
            raise OSError(f"{file_name!r} is not a file name of its own")
        summed: list[_Summed] = []

        def put(f, d=data, out=summed):
            out.append(_Summed(f))
            if callable(d):
                d(out[0])
            else:
                out[0].write(d)
        fsync_write(os.path.join(tmp, file_name), put)
        sums[file_name] = [summed[0].size, summed[0].crc]
    return sums


def _finish(save_dir: str, name: str, tmp: str, final: str, meta: dict,
            files: dict[str, ExtraFile]) -> str | None:
    """Rank 0: ``files`` ({name: bytes, or a function writing them to a binary file}),
    their sizes and crc32s into ``meta``'s checksums, and metadata.json, then publish
    ``tmp`` as ``final`` and point ``latest`` at it; why not (``tmp`` removed), or None."""
    try:
        sums = write_files(tmp, files)
        if sums:
            meta["checksums"]["files"] = sums
        meta["complete"] = meta.pop("complete")  # (written last, as before)
        fsync_write(os.path.join(tmp, "metadata.json"),
                     lambda f: f.write(json.dumps(meta, indent=1).encode()))
        publish(save_dir, name, tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"--save {save_dir}: finishing checkpoint {name} failed ({e})"
    return None


def _same_units_everywhere(ps: ParallelState, units: list) -> bool:
    """True when every rank of each pipeline stage has the same unit structure (names,
    TP-local numels), which ``zero_layout`` (one entry per stage) assumes. One tiny
    all-reduce over the world: stage s's max crc and max -crc in slots s and pp + s
    (the other stages' slots hold a floor below any crc), so max == min per stage."""
    crc, pp = zlib.crc32(json.dumps(units).encode()), ps.pp_size
    t = torch.full((2 * pp,), -(1 << 40), dtype=torch.int64, device=ps.device)
    t[ps.pp_rank], t[pp + ps.pp_rank] = crc, -crc
    ps.world_group.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return all(int(t[s]) == -int(t[pp + s]) for s in range(pp))


def format_version(ps: ParallelState) -> int:
    """The format a save at ``ps``'s layout writes (hybrid/checkpoint/files.py): experts over
    EP, 5; else a pipeline, 4; else 3 (each older hybrid reads what it can)."""
    return EXPERT_VERSION if ps.experts_split else (
        PIPELINE_VERSION if ps.pp_size > 1 else VERSION)


def _spec_dict(p) -> dict:
    spec = split_spec(p)  # (a TP split, or experts over EP)
    if spec is None:
        return {"full_shape": list(p.shape), "dim": None, "tp_rank": 0, "tp_size": 1}
    return {"full_shape": list(spec.full_shape), "dim": spec.dim, "tp_rank": spec.rank,
            "tp_size": spec.size}


def publish(save_dir: str, name: str, tmp: str, final: str) -> None:
    """tmp -> final (an older final of the same name moves aside first), then latest."""
    old = None
    if os.path.exists(final):
        old = os.path.join(save_dir, f".old_{name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    latest_tmp = os.path.join(save_dir, f".{LATEST}.tmp")
    fsync_write(latest_tmp, lambda f: f.write(name.encode()))
    os.replace(latest_tmp, os.path.join(save_dir, LATEST))
    _fsync_dir(save_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _prune(save_dir: str, keep_last: int, keep: str) -> None:
    names = complete_checkpoints(save_dir)
    for n in names[:-keep_last]:
        if n != keep:
            shutil.rmtree(os.path.join(save_dir, n), ignore_errors=True)
