"""Load a checkpoint into a running engine, in the same layout or any other.

What a rank opens: ``latest``, ``metadata.json``, in the same world layout its
own header (for the RNG states), and the data files holding its pieces -- in
the same ZeRO layout only its own. Nothing here loops over the old world.
"""

from __future__ import annotations

import io
import os

import torch

from hybrid.checkpoint.files import find_checkpoint, rank_paths, read_metadata
from hybrid.checkpoint.layout import ROW_BYTES, SavedLayout
from hybrid.checkpoint.reader import RangeReader
from hybrid.checkpoint.reshard import ParamSource, Target
from hybrid.checkpoint.save import agree, model_signature
from hybrid.errors import CheckpointError
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import TPRNGTracker, seed_all
from hybrid.tensor_parallel.random import set_device_rng_state
from hybrid.zero import ZeroEngine
from hybrid.zero.state import load_shard_state


def check_model(meta: dict, model: torch.nn.Module, vocab_size: int | None, where: str) -> None:
    """Same parameter names and full shapes (the padded vocabulary rows may differ)."""
    saved, mine = meta["model"], model_signature(model)
    if set(saved) != set(mine):
        extra, missing = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
        raise CheckpointError(f"{where}: checkpoint is for a different model (it has "
                              f"{extra[:3]} this model lacks, lacks {missing[:3]}); check "
                              f"--num-layers")
    for name, shape in mine.items():
        old = saved[name]
        if old == shape:
            continue
        vocab_ok = (name == "wte.weight" and old[1:] == shape[1:] and vocab_size is not None
                    and meta.get("vocab_size") == vocab_size and min(old[0], shape[0]) >= vocab_size)
        if not vocab_ok:
            raise CheckpointError(f"{where}: checkpoint is for a different model: {name} is "
                                  f"{old} there and {shape} here; check --hidden-size, "
                                  f"--num-attention-heads, --ffn-hidden-size, --seq-length / "
                                  f"--max-position-embeddings and the tokenizer")


def load_checkpoint(load_dir: str, engine: ZeroEngine, ps: ParallelState, cfg,
                    rng: TPRNGTracker, vocab_size: int | None = None,
                    allow_empty: bool = False,
                    reader: RangeReader | None = None) -> tuple[int, int] | None:
    """Restore weights, optimizer, loss scale and RNG; return (iteration, consumed samples).

    Collective over the world (the parameters are republished, and a read error on
    any rank makes every rank raise). ``allow_empty``: a directory with no
    checkpoint yet means "start fresh" (the resume-from-own-saves pattern,
    ``--load`` equal to ``--save``) instead of an error. RNG states come back
    exactly when the world layout is the same; otherwise the streams are reseeded
    from ``--seed`` and the iteration. ``reader``: pass a
    :class:`RangeReader` to learn what this rank opened and read.
    """
    if allow_empty and not os.path.exists(load_dir):
        return None
    ckpt = find_checkpoint(load_dir)
    if ckpt is None:
        if allow_empty:
            return None
        raise CheckpointError(f"--load {load_dir}: no checkpoint there (no 'latest' file and "
                              f"no complete iter_* directory)")
    reader = reader if reader is not None else RangeReader()
    meta = read_metadata(ckpt, reader)
    check_model(meta, engine.model, vocab_size, os.path.join(ckpt, "metadata.json"))
    layout = SavedLayout(meta, ckpt)
    same_layout = (meta["world_size"] == ps.world_size
                   and meta["tensor_model_parallel_size"] == ps.tp_size)
    # [Note: one error, every rank] Only this rank's files are read here, so a bad
    # file fails one rank; it records the error, the others go on (zeros after a
    # failure), all meet in publish_params and agree, and every rank raises.
    error: CheckpointError | None = None
    header = None
    if same_layout:
        try:
            header = _read_header(ckpt, ps, layout, reader)
        except CheckpointError as e:
            error = e
    source = ParamSource(layout, reader)
    targets = {n: Target.of(p, ps.tp_rank) for n, p in engine.model.named_parameters()}

    def fetch(name, lo, hi):
        nonlocal error
        if error is None:
            try:
                return source.read(name, targets[name], lo, hi)
            except CheckpointError as e:
                error = e
        return torch.zeros(hi - lo, 3)

    try:
        load_shard_state(engine, fetch, meta["step"], meta["loss_scaler"])
    finally:
        reader.close()
    if agree(ps, error is not None):
        raise error or CheckpointError(f"--load {load_dir}: another rank could not read its "
                                       f"part of {ckpt} (see its error)")
    iteration, consumed = meta["iteration"], meta["consumed_samples"]
    if header is not None and "rng" in header:
        saved = header["rng"]
        set_device_rng_state(saved["device"], ps.device)
        torch.set_rng_state(saved["cpu"])
        rng.set_states(saved["tracker"])
    else:  # another layout: per-rank streams do not map; start fresh ones, deterministically
        rng.set_states(seed_all(cfg.seed + iteration, ps.tp_rank, ps.dp_rank,
                                ps.device).get_states())
    return iteration, consumed


def _read_header(ckpt: str, ps: ParallelState, layout: SavedLayout,
                 reader: RangeReader) -> dict:
    """This rank's header (same world layout), checked against the metadata's layout."""
    path = rank_paths(ckpt, ps.rank)[0]
    try:
        data = reader.read_whole(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing checkpoint shard") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint shard ({e})") from e
    try:
        header = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unreadable header is a corrupt checkpoint
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint shard "
                              f"({type(e).__name__}: {e})") from e
    if not isinstance(header, dict) or header.get("rank") != ps.rank:
        raise CheckpointError(f"{path}: corrupt checkpoint shard (not rank {ps.rank}'s header)")
    # Its data file must hold what the metadata's layout says it does.
    expect = layout.data_bytes(ps.dp_rank) // ROW_BYTES
    if header.get("data_rows") != expect:
        raise CheckpointError(f"{path}: piece table ({header.get('data_rows')} rows) "
                              f"disagrees with metadata.json's zero_layout ({expect} rows)")
    return header
