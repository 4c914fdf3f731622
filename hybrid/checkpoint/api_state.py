"""Checkpoints of a ``hybrid.initialize`` engine: the training script's format, plus the
caller's ``client_state`` and the engine's counters, in metadata.json.

The engine (:class:`hybrid.train.api.Engine`) is read by its attributes only
(``zero``, ``ps``, ``cfg``, ``rng``, ``lr_scheduler``, ``global_steps``,
``global_samples``, ``micro_steps``, ``train_batch_size()``,
``gradient_accumulation_steps()``), so this module stays below the training package.

[Note: tags]
Without a tag a save is hybrid's ``SAVE/iter_NNNNNNN``, the name
``pretrain_gpt.py`` writes and resumes. A tag (DeepSpeed's ``tag=``, any name
that is one directory) is a directory of its own, ``SAVE/<tag>/``, holding
that tag's newest save in hybrid's layout (``SAVE/<tag>/latest`` and
``SAVE/<tag>/iter_NNNNNNN``; the tag's older saves are pruned), and
``SAVE/latest`` then holds the tag, as DeepSpeed's does. Loading without a tag
follows ``SAVE/latest`` either way (an ``iter_*`` name, or a tag's directory);
``pretrain_gpt.py --load SAVE/<tag>`` resumes a tagged save. A tag that is a
step (``5``, ``"global_step5"``) with no directory of that name loads
``SAVE/iter_0000005``. Every rank writes (and reads) one checkpoint together, so
the tag is rank 0's on every rank; a rank that passed another (DeepSpeed's
getting-started tutorial tags a save with its rank's own ``loss.item()``) is
named in one warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zlib

import torch

from hybrid.checkpoint.files import LATEST, iter_name
from hybrid.checkpoint.load import load_checkpoint
from hybrid.checkpoint.save import save_checkpoint
from hybrid.errors import CheckpointError

log = logging.getLogger("hybrid")


def _agreed_tag(ps, tag, where: str) -> str | None:
    """Rank 0's ``tag`` (as a string; None for none) on every rank, and one warning on
    rank 0 when some rank passed another. Collective over the world."""
    data = b"" if tag is None else str(tag).encode()
    mine = torch.tensor([-1 if tag is None else len(data), zlib.crc32(data)], dtype=torch.int64,
                        device=ps.device)
    first = mine.clone()
    ps.world_group.broadcast(first, src=0)
    differ = (mine != first).any().to(torch.int64).reshape(1)
    ps.world_group.all_reduce(differ, op=torch.distributed.ReduceOp.MAX)
    n = int(first[0])
    if n < 0:
        agreed = None
    else:
        buf = torch.tensor(list(data) if ps.rank == 0 else [0] * n, dtype=torch.uint8,
                           device=ps.device)
        if n:
            ps.world_group.broadcast(buf, src=0)
        agreed = bytes(buf.cpu().tolist()).decode()
    if int(differ[0]) and ps.rank == 0:
        log.warning("%s(tag=%r): the ranks passed different tags; every rank uses rank 0's, "
                    "as they write one checkpoint together (pass the same tag on every rank)",
                    where, agreed)
    return agreed


def _tag_name(tag, where: str) -> str:
    """``tag`` as a directory name, or a ValueError saying why it cannot be one."""
    name = str(tag)
    if (not name or name in (".", "..", LATEST) or name.startswith((".", "iter_"))
            or os.sep in name or (os.altsep and os.altsep in name)):
        raise ValueError(f"{where}(tag={tag!r}): a tag names one directory under the "
                         f"checkpoint directory: not empty, no path separator, not starting "
                         f"with '.' or 'iter_' (hybrid's own names), not {LATEST!r}")
    return name


def _write_latest(save_dir: str, name: str) -> None:
    tmp = os.path.join(save_dir, f".{LATEST}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))


def _barrier(ps) -> None:
    ps.world_group.all_reduce(torch.zeros(1, device=ps.device))


def save_engine(engine, save_dir: str, tag, client_state: dict, save_latest: bool = True) -> str:
    """Collective over the world: write the engine's checkpoint (the module note);
    returns its directory."""
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_checkpoint(client_state=...): hybrid records it in "
                         f"metadata.json, so its values must be JSON ({e})") from None
    tag = _agreed_tag(engine.ps, tag, "save_checkpoint")
    if tag is None and not save_latest:  # a name of its own, so that latest stays
        tag = f"global_step{engine.global_steps}"
    name = None if tag is None else _tag_name(tag, "save_checkpoint")
    extra = {"client_state": client_state, "lr_scheduler": engine.lr_scheduler.state_dict(),
             "api": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                     "global_samples": engine.global_samples, "tag": name}}
    target = save_dir if name is None else os.path.join(save_dir, name)
    path = save_checkpoint(target, engine.global_steps,
                           engine.global_steps * engine.train_batch_size(), engine.zero,
                           engine.ps, engine.cfg.to_dict(), engine.rng, extra_meta=extra,
                           keep_last=None if name is None else 1)
    if name is not None and save_latest:
        if engine.ps.rank == 0:
            _write_latest(save_dir, name)
        _barrier(engine.ps)  # no rank reads latest before it names the tag
    return path


def _resolve(load_dir: str, tag) -> tuple[str, int | None] | None:
    """(the directory to load the newest save of, or the save of step N in it) for
    ``tag`` under ``load_dir``; None for nothing to load (no tag, and no directory or
    no ``latest`` there)."""
    if tag is None:
        if not os.path.isdir(load_dir):
            return None
        latest = os.path.join(load_dir, LATEST)
        if os.path.isfile(latest):
            with open(latest, encoding="utf-8", errors="replace") as f:
                name = f.read().strip()
            if (name and not os.path.isfile(os.path.join(load_dir, name, "metadata.json"))
                    and os.path.isdir(os.path.join(load_dir, name))):
                return os.path.join(load_dir, name), None  # a tag's directory
        return load_dir, None  # hybrid's names (or nothing: the load says so)
    name = _tag_name(tag, "load_checkpoint")
    if os.path.isdir(os.path.join(load_dir, name)):
        return os.path.join(load_dir, name), None
    step = re.fullmatch(r"(?:global_step)?(\d+)", name)
    if step and os.path.isdir(os.path.join(load_dir, iter_name(int(step.group(1))))):
        return load_dir, int(step.group(1))
    there = sorted(n for n in os.listdir(load_dir) if not n.startswith(".")) if os.path.isdir(
        load_dir) else []
    raise CheckpointError(f"load_checkpoint({load_dir!r}, tag={tag!r}): no checkpoint of that "
                          f"tag there ({'it holds ' + ', '.join(there[:12]) if there else 'empty'}"
                          f"); pass tag=None to load the one 'latest' names")


def load_engine(engine, load_dir: str, tag, optimizer: bool, schedule: bool):
    """Collective: restore the checkpoint ``tag`` names under ``load_dir`` (the module
    note) into the engine; returns (its directory, its client_state), or (None, None)
    when there is none and no ``tag`` was asked for."""
    where = _resolve(load_dir, _agreed_tag(engine.ps, tag, "load_checkpoint"))
    if where is None:
        return None, None
    info: dict = {}
    got = load_checkpoint(where[0], engine.zero, engine.ps, engine.cfg.seed, engine.rng,
                          allow_empty=tag is None, load_optim=optimizer, info=info,
                          step=where[1])
    if got is None:
        return None, None
    meta = info["metadata"]
    api = meta.get("api", {})
    steps = api.get("global_steps", meta["iteration"])
    engine.global_steps = steps
    engine.micro_steps = api.get("micro_steps", steps * engine.gradient_accumulation_steps())
    engine.global_samples = api.get("global_samples", meta["consumed_samples"])
    if schedule and "lr_scheduler" in meta:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    return info["checkpoint"], meta.get("client_state", {})
