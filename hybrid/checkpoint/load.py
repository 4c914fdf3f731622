"""Load a checkpoint into a running engine, in the same layout or any other.

What a rank opens: ``latest``, ``metadata.json``, and the data files holding
its pieces -- in the same ZeRO layout only its own; under pipeline parallelism
only those of the old stages that held its stage's parameters -- each with its header
(the data file's checksums; in the same world layout also the RNG states).
Of the data files it reads only the column blocks it loads: the master values
alone when the optimizer is not loaded. Every byte read is checked against
the checksums saved with it (:mod:`hybrid.checkpoint.integrity`). Nothing here
loops over the old world.
"""

from __future__ import annotations

import logging
import os

import torch

from hybrid.checkpoint.files import find_checkpoint, rank_paths, read_metadata, step_checkpoint
from hybrid.checkpoint.integrity import Integrity
from hybrid.checkpoint.layout import SavedLayout
from hybrid.checkpoint.reader import RangeReader
from hybrid.checkpoint.reshard import ParamSource, Target
from hybrid.checkpoint.save import model_signature, whole_model_signature
from hybrid.config.architecture import architecture_fields
from hybrid.config.model import ModelConfig
from hybrid.errors import CheckpointError
from hybrid.parallel.agree import agree_error
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import TPRNGTracker, seed_all
from hybrid.tensor_parallel.random import set_device_rng_state
from hybrid.zero import ZeroEngine
from hybrid.zero.state import load_shard_state

log = logging.getLogger("hybrid")

# Split along dim 0 with padding rows that depend on TP: their row count may differ.
VOCAB_PARAMS = ("wte.weight", "output_layer.weight")


def _check_gelu(meta: dict, model: torch.nn.Module, where: str) -> None:
    """The same GELU as the checkpoint's (the parameters cannot tell them apart)."""
    cfg, saved = getattr(model, "cfg", None), meta.get("config")
    if not isinstance(cfg, ModelConfig) or cfg.swiglu or not isinstance(saved, dict):
        return
    tanh = architecture_fields(saved)["openai_gelu"]
    if tanh != cfg.openai_gelu:
        raise CheckpointError(f"{where}: checkpoint was trained with the "
                              f"{'tanh' if tanh else 'exact'} GELU, this run computes the "
                              f"{'tanh' if cfg.openai_gelu else 'exact'} one: "
                              f"{'add' if tanh else 'drop'} --openai-gelu")


def check_model(meta: dict, model: torch.nn.Module, vocab_size: int | None, where: str,
                signature: dict | None = None) -> None:
    """Same parameter names and full shapes (the padded vocabulary rows may differ) as
    ``signature``, the whole model's (:func:`~hybrid.checkpoint.save.whole_model_signature`
    when ``model`` is one pipeline stage; default ``model``'s own)."""
    saved = meta["model"]
    mine = model_signature(model) if signature is None else signature
    if set(saved) != set(mine):
        extra, missing = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
        # an MoE layer's experts in one and a dense MLP in the other: say so first
        experts = any(".mlp.experts." in n or ".mlp.shared." in n for n in extra + missing)
        moe = ("--num-experts and --moe-layer-freq (one model has MoE layers where the other "
               "has dense MLPs, or other MoE options; a dense checkpoint becomes an MoE one "
               "with scripts/upcycle_checkpoint.py), " if experts else "")
        if any(".deepspeed_experts." in n for n in extra + missing):
            # DeepSpeed's layer names its local experts 0..L-1 on every EP rank: the
            # names, hence the model, depend on the EP size
            saved_ep = meta.get("zero_layout", {}).get("ep_size", 1)
            moe = (f"the deepspeed.moe layers' ep_size (their local experts are numbered "
                   f"per EP rank: load at the EP size the checkpoint was saved at, "
                   f"{saved_ep}), ")
        raise CheckpointError(f"{where}: checkpoint is for a different model (it has "
                              f"{extra[:3]} this model lacks, lacks {missing[:3]}); check "
                              f"{moe}--num-layers and the architecture flags (--normalization, "
                              f"--position-embedding-type, --disable-bias-linear, "
                              f"--add-qkv-bias, --untie-embeddings-and-output-weights)")
    _check_gelu(meta, model, where)
    saved_vocab = meta.get("vocab_size")
    if vocab_size is not None and saved_vocab is not None and vocab_size > saved_vocab:
        # The padded rows can hide it: the extra ids would hit untrained rows, and the
        # others likely mean other tokens. (Fewer ids is allowed: an imported Hugging
        # Face config's vocab_size often exceeds its tokenizer's.)
        # (an import's config is the importing run's: its tokenizer is not the peer's)
        origin = meta.get("imported_from")
        tok = (f"its {origin['format']} run's tokenizer" if origin else
               f"--tokenizer-type {meta.get('config', {}).get('tokenizer_type')}")
        raise CheckpointError(f"{where}: checkpoint was trained on a vocabulary of "
                              f"{saved_vocab} tokens ({tok}), this run's "
                              f"tokenizer has {vocab_size}: give the checkpoint's tokenizer "
                              f"(--tokenizer-type, --vocab-file/--merge-file, "
                              f"--tokenizer-model, --vocab-size)")
    for name, shape in mine.items():
        old = saved[name]
        if old == shape:
            continue
        vocab_ok = (name in VOCAB_PARAMS and old[1:] == shape[1:] and vocab_size is not None
                    and saved_vocab == vocab_size and min(old[0], shape[0]) >= vocab_size)
        if not vocab_ok:
            raise CheckpointError(f"{where}: checkpoint is for a different model: {name} is "
                                  f"{old} there and {shape} here; check --hidden-size, "
                                  f"--num-attention-heads, --ffn-hidden-size, --seq-length / "
                                  f"--max-position-embeddings, --swiglu, --num-query-groups "
                                  f"and the tokenizer")


def load_checkpoint(load_dir: str, engine: ZeroEngine, ps: ParallelState, seed: int,
                    rng: TPRNGTracker, vocab_size: int | None = None,
                    allow_empty: bool = False, reader: RangeReader | None = None, *,
                    load_optim: bool = True, load_rng: bool = True,
                    info: dict | None = None, step: int | None = None) -> tuple[int, int] | None:
    """Restore weights, optimizer, loss scale and RNG; return (iteration, consumed samples).

    Collective over the world (the parameters are republished, and a read error on
    any rank makes every rank raise). ``allow_empty``: a directory with no
    checkpoint yet means "start fresh" (the resume-from-own-saves pattern,
    ``--load`` equal to ``--save``) instead of an error. RNG states come back
    exactly when the world layout is the same (world, TP, CP and PP sizes); otherwise
    the streams are reseeded from ``seed`` (``--seed``) and the iteration. ``reader``:
    pass a :class:`RangeReader` to learn what this rank opened and read.

    ``load_optim`` False (``--no-load-optim``, ``--finetune``): only the fp32 master
    values are read; both Adam moments are zero, the optimizer's step count 0 and
    the loss scaler as the engine built it. True on a weights-only checkpoint
    (``--no-save-optim``) is a CheckpointError naming the flags that load it,
    never a silent restart of the moments. ``load_rng`` False (``--no-load-rng``,
    ``--finetune``): the RNG states are left as they are (seeded from ``--seed``)
    and the rank's header is not read. The iteration and consumed samples are
    returned either way; whether to use them is the caller's choice.
    ``info``: pass a dict to receive ``checkpoint`` (the directory loaded) and
    ``metadata`` (its metadata.json). ``step`` (``--ckpt-step``): load the checkpoint
    of that iteration instead of the newest (CheckpointError if there is none).
    """
    if allow_empty and step is None and not os.path.exists(load_dir):
        return None
    reader = reader if reader is not None else RangeReader()
    # [Note: one error, every rank] Every failure is agreed on over the world before
    # the next collective, and every rank raises the first failing rank's message
    # (which names the file): no rank waits in a collective another rank left, and
    # the message the job prints is the real cause whichever rank hit it.
    # the whole model's names and shapes, to check against the checkpoint's: at PP > 1
    # gathered over the pipeline group, before anything may fail on one rank alone
    signature = whole_model_signature(engine.model, ps)
    error, found = None, None
    try:
        found = _open_metadata(load_dir, engine, vocab_size, allow_empty and step is None,
                               reader, load_optim, step, signature)
    except CheckpointError as e:
        error = str(e)
    error = agree_error(ps, error)
    if error or found is None:  # found None: allow_empty and nothing saved yet (everywhere)
        reader.close()
        if error:
            raise CheckpointError(error)
        return None
    ckpt, meta, layout = found
    header, error = None, None
    same_layout = (meta["world_size"] == ps.world_size
                   and meta["tensor_model_parallel_size"] == ps.tp_size
                   and meta.get("context_parallel_size", 1) == ps.cp_size
                   and meta.get("pipeline_model_parallel_size", 1) == ps.pp_size)
    if same_layout and load_rng:  # only for the RNG states: per-rank streams map 1:1
        try:
            header = _read_header(ckpt, ps, layout, reader)
        except CheckpointError as e:
            error = str(e)
    error = _load_pieces(engine, ps, meta, layout, reader, load_optim, error)
    error = agree_error(ps, error)
    if error:
        raise CheckpointError(error)
    iteration, consumed = meta["iteration"], meta["consumed_samples"]
    if info is not None:
        info.update(checkpoint=ckpt, metadata=meta)
    if load_rng:
        _restore_rng(header, rng, ps, seed + iteration)
    return iteration, consumed


def _columns(engine: ZeroEngine, layout: SavedLayout, ps: ParallelState) -> tuple[str, ...]:
    """The columns to read: those of the engine's optimizer that the checkpoint holds.
    A state the optimizer keeps and the checkpoint lacks (another optimizer saved it)
    starts afresh, and one the checkpoint holds that the optimizer does not keep is
    left: one warning on rank 0 names both."""
    wanted = tuple(engine.optimizer.columns)
    keys = tuple(k for k in wanted if k in layout.columns)
    fresh = [k for k in wanted if k not in layout.columns]
    left = [k for k in layout.columns if k not in wanted]
    if (fresh or left) and ps.rank == 0:
        log.warning("%s: its optimizer kept %s, this one keeps %s: %s%s", layout.ckpt,
                    ", ".join(layout.columns[1:]) or "nothing",
                    ", ".join(wanted[1:]) or "nothing",
                    f"{', '.join(fresh)} start afresh" if fresh else "",
                    ("; " if fresh else "") + f"{', '.join(left)} not loaded" if left else "")
    return keys


def _load_pieces(engine: ZeroEngine, ps: ParallelState, meta: dict, layout: SavedLayout,
                 reader: RangeReader, load_optim: bool, error: str | None) -> str | None:
    """Read this rank's pieces into the engine and republish the parameters; the first
    error this rank met (``error``: one met before), or None. Closes ``reader``."""
    keys = _columns(engine, layout, ps) if load_optim else ("master",)
    source = ParamSource(layout, reader, keys)
    targets = {n: Target.of(p, ps.tp_rank) for n, p in engine.model.named_parameters()}

    def fetch(name, lo, hi):
        # After a failure this rank stops reading but still takes part in the
        # republishing collectives (with zeros) so that every rank reaches the vote.
        nonlocal error
        if error is None:
            try:
                return source.read(name, targets[name], lo, hi)
            except CheckpointError as e:
                error = str(e)
        return torch.zeros(len(keys), hi - lo)

    try:
        if load_optim:
            load_shard_state(engine, fetch, keys, meta["step"], meta["loss_scaler"])
        else:  # a fresh optimizer on the saved weights
            load_shard_state(engine, fetch, keys, 0, None)
        if error is None:  # the blocks read in part: their other bytes are checked now
            try:
                reader.finish()
            except CheckpointError as e:
                error = str(e)
    finally:
        reader.close()
    return error


def _restore_rng(header: dict | None, rng: TPRNGTracker, ps: ParallelState, seed: int) -> None:
    """The saved streams (same world layout: ``header`` read), else fresh ones from ``seed``."""
    if header is not None and "rng" in header:
        saved = header["rng"]
        set_device_rng_state(saved["device"], ps.device)
        torch.set_rng_state(saved["cpu"])
        rng.set_states(saved["tracker"])
    else:  # another layout: per-rank streams do not map; start fresh ones, deterministically
        rng.set_states(seed_all(seed, ps.tp_rank, ps.dp_rank, ps.device, ps.cp_rank,
                                ps.tp_size).get_states())


def weights_only_error(ckpt: str) -> str:
    """Why a ``--no-save-optim`` checkpoint cannot be resumed exactly, and what loads it."""
    return (f"{ckpt}: saved with --no-save-optim (model weights only, no optimizer state), "
            f"so it cannot be resumed exactly: add --no-load-optim to continue from its "
            f"iteration with fresh Adam moments, or --finetune (with --save to a new "
            f"directory) to start a new run at iteration 0 from its weights")


def _open_metadata(load_dir: str, engine: ZeroEngine, vocab_size: int | None,
                   allow_empty: bool, reader: RangeReader, load_optim: bool = True,
                   step: int | None = None, signature: dict | None = None):
    """(checkpoint dir, metadata, SavedLayout) of the newest checkpoint under
    ``load_dir`` (of iteration ``step`` if given), checked against this model (the
    whole model's ``signature`` when it is one stage; and, with ``load_optim``, to hold
    optimizer state); None if there is none and ``allow_empty``. Raises
    CheckpointError naming the file or flag at fault."""
    ckpt = find_checkpoint(load_dir) if step is None else step_checkpoint(load_dir, step)
    if ckpt is None:
        if allow_empty:
            return None
        raise CheckpointError(f"--load {load_dir}: no checkpoint there (no 'latest' file and "
                              f"no complete iter_* directory)")
    meta = read_metadata(ckpt, reader)
    reader.integrity = Integrity(ckpt, meta, check=reader.verify)
    where = os.path.join(ckpt, "metadata.json")
    check_model(meta, engine.model, vocab_size, where, signature)
    layout = SavedLayout(meta, ckpt)
    if load_optim and layout.weights_only:
        raise CheckpointError(weights_only_error(ckpt))
    return ckpt, meta, layout


def _read_header(ckpt: str, ps: ParallelState, layout: SavedLayout,
                 reader: RangeReader) -> dict:
    """This rank's header (same world layout), checked against the metadata's layout."""
    path = rank_paths(ckpt, ps.rank)[0]
    integrity = reader.integrity
    assert isinstance(integrity, Integrity)  # (the load set it when it read the metadata)
    header = integrity.read_header(path, reader)  # checked against its checksum
    if header.get("rank") != ps.rank:
        raise CheckpointError(f"{path}: corrupt checkpoint shard (not rank {ps.rank}'s header)")
    # Its data file must hold what the metadata's layout says it does.
    expect = layout.rows(ps.dp_cp_group.rank,  # ZeRO's rank: DP x CP (hybrid.zero.engine)
                         ps.pp_rank, ps.tp_group.rank)
    if header.get("data_rows") != expect:
        raise CheckpointError(f"{path}: piece table ({header.get('data_rows')} rows) "
                              f"disagrees with metadata.json's zero_layout ({expect} rows)")
    return header
