"""Finding and reading checkpoints on disk; every error names the file."""

from __future__ import annotations

import glob
import json
import logging
import os

from hybrid.checkpoint.reader import RangeReader
from hybrid.errors import CheckpointError

# 2: metadata with the ZeRO unit layout, per rank a header (.pt) and a raw data file (.bin)
#    of interleaved [master, exp_avg, exp_avg_sq] rows
# 3: the same, the data file column by column, the columns named (weights-only saves)
# 4: a pipeline run's (PP > 1): version 3's files, zero_layout one entry per stage
#    (layout.py's Note on stages); a PP 1 save still writes version 3, so a hybrid
#    that predates pipelines reads it, and refuses a version 4 by its number
VERSION = 3  # what saves write at PP 1
PIPELINE_VERSION = 4  # what saves write at PP > 1
READABLE = (2, 3, 4)  # what loads read (layout.SavedLayout.reads knows every data layout)
_OLDER = {1: "one torch file per rank"}
LATEST = "latest"

log = logging.getLogger("hybrid")


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def complete_checkpoints(save_dir: str) -> list[str]:
    """Names of the checkpoints under ``save_dir`` that finished (oldest first)."""
    out = []
    for d in sorted(glob.glob(os.path.join(save_dir, "iter_*"))):
        if os.path.isfile(os.path.join(d, "metadata.json")):
            out.append(os.path.basename(d))
    return out


def find_checkpoint(load_dir: str) -> str | None:
    """Directory of the newest complete checkpoint under ``load_dir`` (None if none)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    latest = os.path.join(load_dir, LATEST)
    stale = None
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8", errors="replace") as f:
            name = f.read().strip()
        if name and os.path.isfile(os.path.join(load_dir, name, "metadata.json")):
            return os.path.join(load_dir, name)
        stale = name
    names = complete_checkpoints(load_dir)  # latest missing or stale: newest complete one
    if stale is not None and names:
        log.warning("%s names %r, which is not a complete checkpoint there; loading %s, "
                    "the newest complete one", latest, stale[:64], names[-1])
    return os.path.join(load_dir, names[-1]) if names else None


def step_checkpoint(load_dir: str, step: int) -> str:
    """Directory of the complete checkpoint of iteration ``step`` under ``load_dir``
    (``--ckpt-step``); CheckpointError naming the ones there otherwise."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    names = complete_checkpoints(load_dir)
    if iter_name(step) not in names:
        have = ", ".join(n.removeprefix("iter_").lstrip("0") or "0" for n in names[-8:])
        raise CheckpointError(f"--ckpt-step {step}: --load {load_dir} holds no complete "
                              f"checkpoint of iteration {step} "
                              f"({f'its iterations: {have}' if names else 'it holds none'})")
    return os.path.join(load_dir, iter_name(step))


def resolve_checkpoint(path: str) -> str:
    """``path`` itself if it is a checkpoint (``iter_*`` with metadata), else the newest
    complete one under it (a ``--save`` directory); CheckpointError if none."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    ckpt = find_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(f"{path}: no checkpoint there")
    return ckpt


def rank_paths(ckpt: str, rank: int) -> tuple[str, str]:
    """(header, data) file paths of ``rank``'s shard."""
    base = os.path.join(ckpt, f"rank_{rank:05d}")
    return base + ".pt", base + ".bin"


def read_metadata(ckpt: str, reader: RangeReader | None = None) -> dict:
    """``ckpt/metadata.json``, checked to be a complete checkpoint of a format this
    hybrid reads (:data:`READABLE`; ``meta["version"]`` says which).

    ``reader``: the load's :class:`RangeReader`, so the read is counted with the rest.
    """
    path = os.path.join(ckpt, "metadata.json")
    try:
        meta = json.loads((reader or RangeReader()).read_whole(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: missing or corrupt checkpoint metadata ({e})") from e
    old, readable = meta.get("version"), " or ".join(map(str, READABLE))
    if old in _OLDER:
        raise CheckpointError(f"{path}: an older checkpoint format (version {old}, "
                              f"{_OLDER[old]}); this hybrid reads version {readable} only: "
                              f"resume it with the hybrid that wrote it")
    if old not in READABLE or not meta.get("complete"):
        raise CheckpointError(f"{path}: not a complete hybrid checkpoint (version "
                              f"{old}, expected {readable})")
    return meta
