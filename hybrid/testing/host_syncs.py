"""Counting the points where the host waits for the device, for tests and benchmarks.

    with HostReads() as reads:        # any device, CPU included
        ...
    reads.count, reads.where          # Python-level reads of tensor values

    with cuda_syncs() as syncs:       # a GPU: what torch itself reports
        ...
    syncs.count

A training step should hand the device work and move on; every read of a
tensor's value into Python (``.item()``, ``float(t)``, ``if t:``, ``.tolist()``,
``torch.equal`` ...) makes the host wait there until the device has computed
it, and the GPU then idles while the host catches up. :class:`HostReads`
intercepts those calls through ``__torch_function__``, so it sees them on the
CPU too, where nothing waits but the same code would on a GPU: a test on a
CPU-only machine fails when a read is put back into the step. It cannot see
syncs inside C++ ops (``nonzero``, a blocking copy); :func:`cuda_syncs` counts
those on a GPU through ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods and functions that return a Python value computed from a tensor's data.
READS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "__complex__",
                   "tolist", "numpy", "cpu", "equal", "allclose", "is_nonzero", "__format__",
                   "__array__"})


class HostReads(TorchFunctionMode):
    """Counts value reads of tensors (see the module docstring) while active.

    ``where``: for each read, the function's name and the innermost frames of
    the caller (file:line), to say which line put a sync back.
    """

    def __init__(self, frames: int = 4):
        super().__init__()
        self.count = 0
        self.where: list[tuple[str, list[str]]] = []
        self._frames = frames

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.count += 1
            stack = traceback.extract_stack(limit=self._frames + 1)[:-1]
            self.where.append((name, [f"{f.filename}:{f.lineno}" for f in stack]))
        return func(*args, **(kwargs or {}))

    def reset(self) -> None:
        self.count = 0
        self.where = []


class _SyncCount:
    count = 0


@contextlib.contextmanager
def cuda_syncs():
    """Count the synchronizing CUDA operations torch reports (sync debug mode "warn")."""
    out = _SyncCount()
    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield out
        finally:
            torch.cuda.set_sync_debug_mode(old)
            out.count = sum("synchronizing" in str(w.message) for w in seen)
