"""Finding and reading checkpoints on disk; every error names the file."""

from __future__ import annotations

import glob
import json
import os

import torch

from hybrid.errors import CheckpointError

VERSION = 1
LATEST = "latest"


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
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            name = f.read().strip()
        if os.path.isfile(os.path.join(load_dir, name, "metadata.json")):
            return os.path.join(load_dir, name)
    names = complete_checkpoints(load_dir)  # latest missing or stale: newest complete one
    return os.path.join(load_dir, names[-1]) if names else None


def resolve_checkpoint(path: str) -> str:
    """``path`` itself if it is a checkpoint (``iter_*`` with metadata), else the newest
    complete one under it (a ``--save`` directory); CheckpointError if none."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    ckpt = find_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(f"{path}: no checkpoint there")
    return ckpt


def read_metadata(ckpt: str) -> dict:
    path = os.path.join(ckpt, "metadata.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: missing or corrupt checkpoint metadata ({e})") from e
    if meta.get("version") != VERSION or not meta.get("complete"):
        raise CheckpointError(f"{path}: not a complete hybrid checkpoint (version "
                              f"{meta.get('version')}, expected {VERSION})")
    return meta


def read_rank_files(ckpt: str, world_size: int) -> list[dict]:
    """Every rank file of a checkpoint, memory-mapped; errors name the bad file."""
    out = []
    for r in range(world_size):
        path = os.path.join(ckpt, f"rank_{r:05d}.pt")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing checkpoint shard")
        try:
            out.append(torch.load(path, mmap=True, weights_only=True, map_location="cpu"))
        except Exception as e:  # noqa: BLE001 - any unreadable file is a corrupt checkpoint
            raise CheckpointError(f"{path}: corrupt or truncated checkpoint shard "
                                  f"({type(e).__name__}: {e})") from e
    return out
