"""One recorded collective and where it was called from (the flight recorder's entries).

An :class:`Entry` is what :mod:`hybrid.diagnostics.recorder` keeps per collective:
its number in its group, op, shape, dtype and the Python frames that called it,
innermost first, skipping torch, the standard library and hybrid's own
plumbing (comm, diagnostics), which say nothing about who called.
"""

from __future__ import annotations

import os

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ROOT = os.path.dirname(os.path.dirname(_HERE.rstrip(os.sep))) + os.sep
_COMM = os.path.join(_ROOT, "hybrid", "parallel", "comm.py")  # the door every collective takes
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep  # site-packages too


def _skip(filename: str) -> bool:
    """Frames that say nothing about who called: torch's wrappers, the standard library
    (threading, multiprocessing), installed packages, comm, this package."""
    return (filename.startswith(_STDLIB) or filename.startswith(_TORCH_DIR)
            or filename.startswith(_HERE) or filename == _COMM or filename.startswith("<"))


def short_path(filename: str) -> str:
    """Path relative to the repository root, else its last three components."""
    if filename.startswith(_ROOT):
        return filename[len(_ROOT):]
    return os.sep.join(filename.split(os.sep)[-3:])


def fmt_frame(frame: tuple) -> str:
    filename, line, func = frame
    return f"{short_path(filename)}:{line} in {func}"


def callers(frame, depth: int = 3, limit: int = 40) -> tuple:
    """Up to ``depth`` (filename, line, function) of the frames that called, innermost
    first, one per source file (a file's own helpers say less than who called them)."""
    out: list[tuple[str, int, str]] = []
    while frame is not None and len(out) < depth and limit > 0:
        code = frame.f_code
        if not _skip(code.co_filename) and (not out or out[-1][0] != code.co_filename):
            out.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
        limit -= 1
    return tuple(out)


class Entry:
    """One collective as this rank issued it. ``state``: issued, done or failed.
    ``peers``: for a point-to-point exchange, the global ranks at its other end (None for
    a collective of the whole group); ``heard``: of those, the ones it receives from --
    its completion proves they got through their send, while a completed send proves
    nothing of its receiver (the bytes may wait in a buffer); ``about``: what the
    exchange is, in words (a pipeline action's, [Note: a stuck exchange] in
    hybrid/diagnostics/report.py)."""

    __slots__ = ("seq", "group", "op", "shape", "dtype", "frames", "t", "state", "peers",
                 "about", "heard")

    def __init__(self, seq, group, op, shape, dtype, frames, t, peers=None, about=None,
                 heard=None):
        self.seq, self.group, self.op = seq, group, op
        self.shape, self.dtype, self.frames, self.t = shape, dtype, frames, t
        self.state = "issued"
        self.peers, self.about, self.heard = peers, about, heard

    @property
    def caller(self) -> str:
        if not self.frames:
            return "an unknown caller"
        head = fmt_frame(self.frames[0])
        via = ", ".join(fmt_frame(f) for f in self.frames[1:])
        return f"{head} (via {via})" if via else head

    def to_dict(self) -> dict:
        return {"seq": self.seq, "group": self.group.name, "ranks": self.group.ranks,
                "op": self.op, "shape": list(self.shape), "dtype": self.dtype,
                "caller": self.caller, "t": self.t, "state": self.state,
                **({} if self.peers is None else {"peers": list(self.peers),
                                                  "heard": list(self.heard or ())}),
                **({} if self.about is None else {"about": self.about})}
