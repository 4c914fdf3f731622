"""Load a checkpoint into a running engine, in the same layout or any other."""

from __future__ import annotations

import os

import torch

from hybrid.checkpoint.files import find_checkpoint, read_metadata, read_rank_files
from hybrid.checkpoint.reshard import FullParams, fit_rows
from hybrid.checkpoint.save import model_signature
from hybrid.errors import CheckpointError
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import TPRNGTracker, full_shape, seed_all
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
                    allow_empty: bool = False) -> tuple[int, int] | None:
    """Restore weights, optimizer, loss scale and RNG; return (iteration, consumed samples).

    ``allow_empty``: a directory with no checkpoint yet means "start fresh" (the
    resume-from-own-saves pattern, ``--load`` equal to ``--save``) instead of an
    error. RNG states come back exactly when the world layout is the same;
    otherwise the streams are reseeded from ``--seed`` and the iteration.
    """
    if allow_empty and not os.path.exists(load_dir):
        return None
    ckpt = find_checkpoint(load_dir)
    if ckpt is None:
        if allow_empty:
            return None
        raise CheckpointError(f"--load {load_dir}: no checkpoint there (no 'latest' file and "
                              f"no complete iter_* directory)")
    meta = read_metadata(ckpt)
    check_model(meta, engine.model, vocab_size, os.path.join(ckpt, "metadata.json"))
    files = read_rank_files(ckpt, meta["world_size"])
    full = FullParams(files, ckpt)
    shapes = {n: list(full_shape(p)) for n, p in engine.model.named_parameters()}
    specs = {n: getattr(p, "tp_spec", None) for n, p in engine.model.named_parameters()}

    def fetch(name, key, lo, hi):
        t = fit_rows(full.full(name, key), shapes[name])
        spec = specs[name]
        if spec is not None:
            t = t.chunk(spec.size, dim=spec.dim)[spec.rank]
        return t.reshape(-1)[lo:hi]

    load_shard_state(engine, fetch, files[0]["step"], files[0]["loss_scaler"])
    iteration, consumed = meta["iteration"], meta["consumed_samples"]
    same_layout = (meta["world_size"] == ps.world_size
                   and meta["tensor_model_parallel_size"] == ps.tp_size)
    if same_layout and "rng" in files[ps.rank]:
        saved = files[ps.rank]["rng"]
        set_device_rng_state(saved["device"], ps.device)
        torch.set_rng_state(saved["cpu"])
        rng.set_states(saved["tracker"])
    else:  # another layout: per-rank streams do not map; start fresh ones, deterministically
        rng.set_states(seed_all(cfg.seed + iteration, ps.tp_rank, ps.dp_rank,
                                ps.device).get_states())
    return iteration, consumed
