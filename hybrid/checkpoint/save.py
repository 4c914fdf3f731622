"""Sharded checkpoints: atomic save, exact resume, and load into any other layout.

On disk::

    SAVE/latest                      "iter_0000100" (written last, atomically)
    SAVE/iter_0000100/metadata.json  config, layout, iteration, consumed samples,
                                     model shapes (readable without torch)
    SAVE/iter_0000100/rank_00003.pt  rank 3's pieces: for each parameter it owns a
                                     piece of, the TP-local element ranges with their
                                     fp32 master values and Adam moments; its TP
                                     shard spec; its RNG states; the optimizer step
                                     and loss-scaler state

A save is written into ``SAVE/.tmp_iter_...``, flushed, and renamed into place,
then ``latest`` is replaced: a crash at any moment leaves the previous
checkpoint complete and pointed to. Errors on any rank (a full disk, a
read-only directory) are agreed on over the world, the temporary is removed,
and every rank raises the same :class:`CheckpointError`; nothing existing is
touched.

[Note: resharding]
A piece is (parameter name, ``[lo, hi)`` of the TP-local parameter flattened),
independent of ZeRO stage, buckets and DP size. Loading rebuilds each full
parameter from the old ranks' pieces and TP specs, one parameter at a time
(files are memory-mapped), then cuts the new rank's TP slice and pieces from
it. The padded vocabulary may differ between TP sizes: rows past the real
vocabulary are zero and are cut or zero-filled.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from hybrid.checkpoint.files import LATEST, VERSION, complete_checkpoints, iter_name
from hybrid.errors import CheckpointError
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import TPRNGTracker
from hybrid.tensor_parallel.random import get_device_rng_state
from hybrid.zero import ZeroEngine
from hybrid.zero.state import shard_state


def agree(ps: ParallelState, failed: bool) -> bool:
    """True when any rank failed (a max over the world), so all ranks act alike."""
    flag = torch.tensor([1.0 if failed else 0.0], device=ps.device)
    ps.world_group.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _fsync_write(path: str, write) -> None:
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


def save_checkpoint(save_dir: str, iteration: int, consumed_samples: int, engine: ZeroEngine,
                    ps: ParallelState, cfg, rng: TPRNGTracker, keep_last: int | None = None,
                    vocab_size: int | None = None) -> str:
    """Write checkpoint ``iteration`` (collective over the world); return its directory."""
    name = iter_name(iteration)
    final, tmp = os.path.join(save_dir, name), os.path.join(save_dir, f".tmp_{name}")
    error = None
    if ps.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = f"--save {save_dir}: cannot create the checkpoint directory ({e})"
    if agree(ps, error is not None):
        raise CheckpointError(error or f"--save {save_dir}: rank 0 could not create {tmp}")

    state = shard_state(engine)
    if engine.stage == 0 and ps.dp_rank != 0:
        state["params"] = {}  # every DP replica holds the same values; one copy is enough
    specs = {n: _spec_dict(p) for n, p in engine.model.named_parameters()}
    payload = {"version": VERSION, "rank": ps.rank, "tp_rank": ps.tp_rank,
               "dp_rank": ps.dp_rank, "specs": specs, **state,
               "rng": {"device": get_device_rng_state(ps.device), "cpu": torch.get_rng_state(),
                       "tracker": rng.get_states()}}
    path = os.path.join(tmp, f"rank_{ps.rank:05d}.pt")
    try:
        _fsync_write(path, lambda f: torch.save(payload, f))
    except (OSError, RuntimeError) as e:
        error = f"--save {save_dir}: writing {path} failed on rank {ps.rank} ({e})"
    if agree(ps, error is not None):
        if ps.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(error or f"--save {save_dir}: another rank failed to write "
                                       f"its shard; nothing was changed")
    if ps.rank == 0:
        try:
            meta = {"version": VERSION, "iteration": iteration,
                    "consumed_samples": consumed_samples, "world_size": ps.world_size,
                    "tensor_model_parallel_size": ps.tp_size,
                    "data_parallel_size": ps.dp_size, "zero_stage": engine.stage,
                    "vocab_size": vocab_size, "model": model_signature(engine.model),
                    "config": cfg.to_dict(), "complete": True}
            _fsync_write(os.path.join(tmp, "metadata.json"),
                         lambda f: f.write(json.dumps(meta, indent=1).encode()))
            _publish(save_dir, name, tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"--save {save_dir}: finishing checkpoint {name} failed ({e})"
    if agree(ps, error is not None):
        raise CheckpointError(error or f"--save {save_dir}: rank 0 could not finish {name}")
    if ps.rank == 0 and keep_last:
        _prune(save_dir, keep_last, keep=name)
    return final


def _spec_dict(p) -> dict:
    spec = getattr(p, "tp_spec", None)
    if spec is None:
        return {"full_shape": list(p.shape), "dim": None, "tp_rank": 0, "tp_size": 1}
    return {"full_shape": list(spec.full_shape), "dim": spec.dim, "tp_rank": spec.rank,
            "tp_size": spec.size}


def _publish(save_dir: str, name: str, tmp: str, final: str) -> None:
    """tmp -> final (an older final of the same name moves aside first), then latest."""
    old = None
    if os.path.exists(final):
        old = os.path.join(save_dir, f".old_{name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    latest_tmp = os.path.join(save_dir, f".{LATEST}.tmp")
    _fsync_write(latest_tmp, lambda f: f.write(name.encode()))
    os.replace(latest_tmp, os.path.join(save_dir, LATEST))
    _fsync_dir(save_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _prune(save_dir: str, keep_last: int, keep: str) -> None:
    names = complete_checkpoints(save_dir)
    for n in names[:-keep_last]:
        if n != keep:
            shutil.rmtree(os.path.join(save_dir, n), ignore_errors=True)


def write_unsharded_checkpoint(save_dir: str, model: dict[str, torch.Tensor], config: dict,
                               vocab_size: int, iteration: int = 0) -> str:
    """A one-rank checkpoint of full fp32 weights with a fresh optimizer (single process).

    For weights that come from elsewhere (a Hugging Face GPT-2): ``--load`` reads it
    into any layout like any other checkpoint.
    """
    name = iter_name(iteration)
    final, tmp = os.path.join(save_dir, name), os.path.join(save_dir, f".tmp_{name}")
    if os.path.exists(final):
        raise CheckpointError(f"{final}: already exists; not overwriting it")
    os.makedirs(tmp)
    params = {n: {"ranges": [(0, t.numel())], "master": t.float().reshape(-1).contiguous(),
                  "exp_avg": torch.zeros(t.numel()), "exp_avg_sq": torch.zeros(t.numel())}
              for n, t in model.items()}
    specs = {n: {"full_shape": list(t.shape), "dim": None, "tp_rank": 0, "tp_size": 1}
             for n, t in model.items()}
    payload = {"version": VERSION, "rank": 0, "tp_rank": 0, "dp_rank": 0, "specs": specs,
               "params": params, "step": 0, "loss_scaler": None}
    _fsync_write(os.path.join(tmp, "rank_00000.pt"), lambda f: torch.save(payload, f))
    meta = {"version": VERSION, "iteration": iteration, "consumed_samples": 0,
            "world_size": 1, "tensor_model_parallel_size": 1, "data_parallel_size": 1,
            "zero_stage": 0, "vocab_size": vocab_size,
            "model": {n: list(t.shape) for n, t in model.items()}, "config": config,
            "complete": True}
    _fsync_write(os.path.join(tmp, "metadata.json"),
                 lambda f: f.write(json.dumps(meta, indent=1).encode()))
    _publish(save_dir, name, tmp, final)
    return final
