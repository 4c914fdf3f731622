"""Checkpoints of a ``hybrid.initialize`` engine: the training script's format, plus the
caller's ``client_state`` and the schedule's step, in metadata.json.

The engine (:class:`hybrid.train.api.Engine`) is read by its attributes only
(``zero``, ``ps``, ``cfg``, ``rng``, ``lr_scheduler``, ``global_steps``,
``train_batch_size``), so this module stays below the training package.
"""

from __future__ import annotations

import json

from hybrid.checkpoint.load import load_checkpoint
from hybrid.checkpoint.save import save_checkpoint
from hybrid.errors import CheckpointError


def _check_tag(tag, where: str, steps: int | None = None) -> None:
    if tag is not None and (steps is None or str(tag) not in (str(steps),
                                                              f"global_step{steps}")):
        raise ValueError(f"{where}(tag={tag!r}): hybrid names checkpoints by step "
                         f"(iter_NNNNNNN) and loads the newest: pass tag=None")


def save_engine(engine, save_dir: str, tag, client_state: dict) -> str:
    """Collective over the world: write the engine's checkpoint; returns its directory."""
    _check_tag(tag, "save_checkpoint", engine.global_steps)
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint(client_state=...): hybrid records it in "
                         f"metadata.json, so its values must be JSON ({e})") from None
    extra = {"client_state": client_state, "lr_scheduler": engine.lr_scheduler.state_dict(),
             "api": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps}}
    return save_checkpoint(save_dir, engine.global_steps,
                           engine.global_steps * engine.train_batch_size, engine.zero,
                           engine.ps, engine.cfg.to_dict(), engine.rng, extra_meta=extra)


def load_engine(engine, load_dir: str, tag, optimizer: bool, schedule: bool):
    """Collective: restore the newest checkpoint under ``load_dir`` into the engine;
    returns (its directory, its client_state)."""
    _check_tag(tag, "load_checkpoint")
    info: dict = {}
    got = load_checkpoint(load_dir, engine.zero, engine.ps, engine.cfg.seed, engine.rng,
                          load_optim=optimizer, info=info)
    if got is None:
        raise CheckpointError(f"load_checkpoint {load_dir}: no checkpoint there")
    meta = info["metadata"]
    steps = meta.get("api", {}).get("global_steps", meta["iteration"])
    engine.global_steps = steps
    engine.micro_steps = meta.get("api", {}).get(
        "micro_steps", steps * engine.gradient_accumulation_steps)
    if schedule and "lr_scheduler" in meta:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    return info["checkpoint"], meta.get("client_state", {})
