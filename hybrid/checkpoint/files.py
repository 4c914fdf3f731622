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
# 5: experts over EP (EP > 1): zero_layout adds ep_size and the experts' names, whose
#    units are sharded over the expert DP group (layout.py's Note on experts)
VERSION = 3  # what saves write at PP 1
PIPELINE_VERSION = 4  # what saves write at PP > 1
EXPERT_VERSION = 5  # what saves write at EP > 1
READABLE = (2, 3, 4, 5)  # what loads read (layout.SavedLayout.reads knows every data layout)
_OLDER = {1: "one torch file per rank"}
LATEST = "latest"

log = logging.getLogger("hybrid")


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# A Megatron-LM torch_dist iteration is also an ``iter_NNNNNNN`` holding a metadata.json:
# its common.pt and torch DCP's .metadata tell it apart (two stats, no read)
_PEER_FILES = ("common.pt", ".metadata")


def is_hybrid_checkpoint(d: str) -> bool:
    """Whether ``d`` is a finished hybrid checkpoint's directory (its metadata.json, and
    none of the files a Megatron-LM torch_dist iteration holds)."""
    return (os.path.isfile(os.path.join(d, "metadata.json"))
            and not any(os.path.exists(os.path.join(d, n)) for n in _PEER_FILES))


def complete_checkpoints(save_dir: str) -> list[str]:
    """Names of the checkpoints under ``save_dir`` that finished (oldest first)."""
    out = []
    for d in sorted(glob.glob(os.path.join(save_dir, "iter_*"))):
        if is_hybrid_checkpoint(d):
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
        if name and is_hybrid_checkpoint(os.path.join(load_dir, name)):
            return os.path.join(load_dir, name)
        stale = name
    names = complete_checkpoints(load_dir)  # latest missing or stale: newest complete one
    if stale is not None and names:
        log.warning("%s names %r, which is not a complete checkpoint there; loading %s, "
                    "the newest complete one", latest, stale[:64], names[-1])
    if not names:
        refuse_foreign(load_dir)  # "nothing to load" only where there is nothing
    return os.path.join(load_dir, names[-1]) if names else None


# [Note: another framework's checkpoint is not an empty directory]
# A directory without a hybrid checkpoint means "start from the initial weights" (DeepSpeed's
# load_checkpoint returns (None, None) there, and --load of a new run's --save directory
# does the same). A directory holding another framework's checkpoint must not: a run told
# to resume would silently start over. These are the files that show each format, looked
# for in the directory and one level down (a tag's or an iteration's directory): a bounded
# number of globs, whatever the directory holds.
_FOREIGN = (
    ("DeepSpeed", ("mp_rank_*_model_states.pt", "*zero_pp_rank_*_optim_states.pt",
                   "*/mp_rank_*_model_states.pt", "*/*zero_pp_rank_*_optim_states.pt")),
    ("Megatron-LM", ("latest_checkpointed_iteration.txt", "mp_rank_*/model_optim_rng.pt",
                     "*/mp_rank_*/model_optim_rng.pt", "iter_*/common.pt", "common.pt")),
    ("torch.distributed.checkpoint (DCP)", (".metadata", "*/.metadata")),
)


def foreign_checkpoint(path: str) -> tuple[str, str] | None:
    """(the format, a file that shows it) when ``path`` holds a checkpoint another
    framework wrote (the Note above); None otherwise."""
    for fmt, patterns in _FOREIGN:
        for pattern in patterns:
            found = sorted(glob.glob(os.path.join(glob.escape(path), pattern)))
            if found:
                return fmt, found[0]
    return None


def refuse_foreign(path: str) -> None:
    """CheckpointError naming the format and the file, when ``path`` holds a checkpoint of
    another framework; nothing otherwise."""
    found = foreign_checkpoint(path)
    if found is not None:
        fmt, shown_by = found
        raise CheckpointError(
            f"{path} holds a {fmt} checkpoint ({shown_by}), which hybrid does not read as it "
            f"is: incomplete (a latest naming a tag or iteration not there) or of a kind "
            f"hybrid does not import (docs/checkpoints.md); skipping it would start training "
            f"over from the initial weights: point --load (or load_checkpoint) at a directory "
            f"hybrid saved, or at an empty one to start fresh")


def step_checkpoint(load_dir: str, step: int) -> str:
    """Directory of the complete checkpoint of iteration ``step`` under ``load_dir``
    (``--ckpt-step``); CheckpointError naming the ones there otherwise."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    names = complete_checkpoints(load_dir)
    if iter_name(step) not in names:
        have = ", ".join(n.removeprefix("iter_").lstrip("0") or "0" for n in names[-8:])
        unfinished = f".tmp_{iter_name(step)}"
        why = (f"; {unfinished} there is a save of it that never finished (a rank stopped "
               f"while writing it), which no load takes"
               if os.path.isdir(os.path.join(load_dir, unfinished)) else "")
        raise CheckpointError(f"--ckpt-step {step}: --load {load_dir} holds no complete "
                              f"checkpoint of iteration {step} "
                              f"({f'its iterations: {have}' if names else 'it holds none'})"
                              f"{why}")
    return os.path.join(load_dir, iter_name(step))


def resolve_checkpoint(path: str) -> str:
    """``path`` itself if it is a checkpoint (``iter_*`` with metadata), else the newest
    complete one under it (a ``--save`` directory); CheckpointError if none."""
    if is_hybrid_checkpoint(path):
        return path
    found = (foreign_checkpoint(path) if os.path.isdir(path) and not complete_checkpoints(path)
             else None)
    if found is not None:  # (a tool's input: hybrid reads it, through an import)
        raise CheckpointError(f"{path} holds a {found[0]} checkpoint ({found[1]}), not a "
                              f"hybrid one, which this tool reads: import it first "
                              f"(scripts/pretrain_gpt.py --load {path} --save NEW and the "
                              f"model's flags) and give it NEW")
    ckpt = find_checkpoint(path)  # (refuses another framework's, by name)
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
        refuse_foreign(os.path.dirname(ckpt.rstrip(os.sep)) or ".")  # Megatron's torch_dist
        raise CheckpointError(f"{path}: not a complete hybrid checkpoint (version "
                              f"{old}, expected {readable})")
    return meta
