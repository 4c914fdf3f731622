"""Files a piece of code opens under a directory, recorded by wrapping ``open`` and
``os.open`` (an independent count of what the checkpoint reader says it read)."""

from __future__ import annotations

import builtins
import contextlib
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
