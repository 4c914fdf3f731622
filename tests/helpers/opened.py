"""Files a piece of code opens under a directory, recorded by wrapping ``open`` and
``os.open`` (an independent count of what the checkpoint reader says it read)."""

from __future__ import annotations

import builtins
import contextlib
import json
import os


@contextlib.contextmanager
def files_opened(root: str):
    """Inside the block every ``open`` / ``os.open`` of a path under ``root`` is recorded;
    yields the list of their paths relative to ``root``, in order."""
    root = os.path.abspath(root) + os.sep
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def record(path):
        path = os.path.abspath(os.fspath(path))
        if path.startswith(root):
            opened.append(os.path.relpath(path, root))

    def open_(file, *a, **k):
        if isinstance(file, (str, os.PathLike)):
            record(file)
        return real_open(file, *a, **k)

    def os_open(path, *a, **k):
        record(path)
        return real_os_open(path, *a, **k)

    builtins.open, os.open = open_, os_open  # type: ignore[assignment]
    try:
        yield opened
    finally:
        builtins.open, os.open = real_open, real_os_open


def recording_rank(ps, cfg):
    """scripts/pretrain_gpt.py's work on one rank, recording every file it opens under
    ``--load`` (an independent count of the checkpoint reader's); the list ends its
    stdout as one line ``OPENED <rank> <json>``."""
    from tests.helpers.launch import _pretrain_rank
    with files_opened(cfg.checkpoint.load) as opened:
        code, out, err, report = _pretrain_rank(ps, cfg)
    return code, out + f"\nOPENED {ps.rank} {json.dumps(opened)}\n", err, report


def opened_by_rank(stdout):
    """{rank: [files opened under --load]} from :func:`recording_rank`'s lines."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("OPENED "):
            _, rank, files = line.split(" ", 2)
            out[int(rank)] = json.loads(files)
    return out


def own_files(rank: int, iteration: int = 3) -> set[str]:
    """A rank's two files (header, data) of a checkpoint's iteration directory."""
    return {f"iter_{iteration:07d}/rank_{rank:05d}.pt", f"iter_{iteration:07d}/rank_{rank:05d}.bin"}
