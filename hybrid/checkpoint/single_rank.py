"""Checkpoints of one rank holding every parameter whole (TP 1, DP 1, stage 0), written
in one process: a peer's import (:mod:`hybrid.checkpoint.peers.importing`), a Hugging
Face model's weights (``scripts/import_hf.py``), an upcycled MoE
(``scripts/upcycle_checkpoint.py``). ``--load`` reads them into any layout like any other
checkpoint; they are written one parameter at a time, published as a save is
(:func:`hybrid.checkpoint.save.publish`)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping

import torch

from hybrid.checkpoint.files import VERSION, iter_name, rank_paths
from hybrid.checkpoint.integrity import ALGORITHM, BlockSums, crc32, header_bytes
from hybrid.checkpoint.layout import COLUMNS, single_file_layout
from hybrid.checkpoint.save import ExtraFile, fsync_write, publish, write_files
from hybrid.errors import CheckpointError


def write_unsharded_checkpoint(save_dir: str, model: dict[str, torch.Tensor], config: dict,
                               vocab_size: int, iteration: int = 0) -> str:
    """A one-rank checkpoint of full fp32 weights with a fresh optimizer (single process).

    For weights that come from elsewhere (a Hugging Face GPT-2): ``--load`` reads it
    into any layout like any other checkpoint. Written one parameter at a time.
    """
    shapes = {n: list(t.shape) for n, t in model.items()}

    def read(name: str) -> dict[str, torch.Tensor]:
        t = model[name].detach().float()
        return {"master": t, "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}

    return write_single_rank_checkpoint(save_dir, shapes, read, COLUMNS, config, vocab_size,
                                        iteration=iteration)


def write_single_rank_checkpoint(save_dir: str, shapes: dict[str, list[int]], read,
                                 columns: tuple[str, ...], config: dict,
                                 vocab_size: int | None, *, iteration: int = 0,
                                 consumed_samples: int = 0, step: int = 0,
                                 extra: dict | None = None, beat=None,
                                 frozen_shapes: dict[str, list[int]] | None = None,
                                 files: Mapping[str, ExtraFile] | None = None,
                                 loss_scaler: dict | None = None) -> str:
    """A checkpoint of one rank holding every parameter whole (TP 1, DP 1, stage 0), as
    ``SAVE/iter_N``, published atomically like a save (an existing one is refused).

    ``read(name)`` gives ``{column: full fp32 tensor}`` for each of ``columns`` (``master``
    first; all of :data:`COLUMNS`, or ``master`` alone for a weights-only checkpoint);
    it is called once per parameter, in ``shapes``' order, and each column is written at
    its place in the data file as it comes (positional writes), so memory holds one
    parameter at a time whatever the model's size. The data file's checksums are then
    computed from the file in one sequential pass. ``step``: the optimizer's step count
    (0 with no moments); ``extra``: more metadata.json keys (where a checkpoint came from).
    ``beat()``: called after each parameter and each 8 MiB hashed (the importing rank
    keeps the waiting ones' collectives short: :mod:`hybrid.checkpoint.peers.importing`).
    ``frozen_shapes``: the model's frozen parameters (in its signature, ``model``, but in
    no unit: their values go in ``files``); ``files``: {name: bytes}, small whole files
    written beside metadata.json with their size and crc32 in its checksums, as
    :func:`save_checkpoint`'s ``extra_files``. ``loss_scaler``: an fp16 run's
    :class:`~hybrid.zero.loss_scaler.LossScaler` state (None: the run's own start).
    """
    beat = beat or (lambda: None)
    name = iter_name(iteration)
    final, tmp = os.path.join(save_dir, name), os.path.join(save_dir, f".tmp_{name}")
    if os.path.exists(final):
        raise CheckpointError(f"{final}: already exists; not overwriting it")
    if columns not in (COLUMNS, COLUMNS[:1]):
        raise ValueError(f"columns {columns}: all of {COLUMNS} or ('master',)")
    shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt that never finished
    os.makedirs(tmp)
    numel = {n: _prod(s) for n, s in shapes.items()}
    table, rows = {}, 0
    for n in shapes:
        table[n] = [(0, numel[n], rows)]
        rows += numel[n]
    try:
        head_path, data_path = rank_paths(tmp, 0)
        with open(data_path, "wb") as f:
            f.truncate(rows * len(columns) * 4)
            fd = f.fileno()
            for n, shape in shapes.items():
                values = read(n)
                base = table[n][0][2]
                for c, key in enumerate(columns):
                    t = values[key]
                    if list(t.shape) != list(shape):
                        raise CheckpointError(f"{n}: {key} has shape {list(t.shape)}, "
                                              f"expected {list(shape)}")
                    view = t.detach().float().contiguous().reshape(-1).numpy().data.cast("B")
                    os.pwrite(fd, view, (c * rows + base) * 4)
                beat()
            f.flush()
            os.fsync(fd)
        sums = _hash_columns(data_path, len(columns), rows * 4, beat)
        specs = {n: {"full_shape": s, "dim": None, "tp_rank": 0, "tp_size": 1}
                 for n, s in shapes.items()}
        header = {"version": VERSION, "rank": 0, "tp_rank": 0, "dp_rank": 0, "specs": specs,
                  "step": step, "loss_scaler": loss_scaler, "pieces": table, "data_rows": rows,
                  "checksums": sums.table()}
        data = header_bytes(header)
        fsync_write(head_path, lambda f: f.write(data))
        file_sums = write_files(tmp, files or {})
        layout = single_file_layout(shapes)
        layout["columns"] = list(columns)
        meta = {"version": VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
                "world_size": 1, "tensor_model_parallel_size": 1, "data_parallel_size": 1,
                "zero_stage": 0, "vocab_size": vocab_size,
                "model": {**shapes, **(frozen_shapes or {})}, "step": step,
                "loss_scaler": loss_scaler, "zero_layout": layout, "config": config,
                "checksums": {"algorithm": ALGORITHM,
                              "headers": {os.path.basename(head_path): [len(data), crc32(data)]},
                              **({"files": file_sums} if file_sums else {})},
                **(extra or {}), "complete": True}
        fsync_write(os.path.join(tmp, "metadata.json"),
                     lambda f: f.write(json.dumps(meta, indent=1).encode()))
    except BaseException:  # a reader's error, a full disk: nothing is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(save_dir, name, tmp, final)
    return final


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _hash_columns(data_path: str, columns: int, column_bytes: int, beat) -> BlockSums:
    """The block checksums of a data file of ``columns`` blocks of ``column_bytes`` each,
    hashed as a save hashes its columns, reading 8 MiB at a time (``beat()`` after each)."""
    sums = BlockSums()
    with open(data_path, "rb") as src:
        for _ in range(columns):
            sums.column()
            left = column_bytes
            while left:
                chunk = src.read(min(left, 8 << 20))
                sums.update(memoryview(chunk))
                left -= len(chunk)
                beat()
    return sums
