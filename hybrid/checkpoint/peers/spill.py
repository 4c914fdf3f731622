"""Tensors parked in files and mapped back, for the exports that must hand a writer the
whole model's state at once (DCP's ``dcp.save`` takes one state dict; DeepSpeed's files
are each DP rank's partition of every parameter).

    spill = Spill(scratch_dir)     # creates it
    t = spill.zeros(n)             # n fp32 zeros in a file, mapped shared
    u = spill.keep(tensor)         # a copy of ``tensor`` in a file, mapped
    spill.close()                  # unmaps nothing itself: drop the tensors, then close

The mapped tensors are backed by the page cache, not by the process's memory: what a
writer reads of them is paged in and can be paged out again, so the export's resident
memory stays about one parameter whatever the model's size, at the cost of writing the
state once more to the scratch directory (removed by :meth:`Spill.close`).
"""

from __future__ import annotations

import os
import shutil

import torch


class Spill:
    """A scratch directory of mapped fp32 tensors (its module docstring)."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root)
        self._count = 0

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``numel`` zeros in a new file (sparse until written), mapped shared: writes to
        the tensor go to the file."""
        path = os.path.join(self.root, str(self._count))
        self._count += 1
        with open(path, "wb") as f:
            f.truncate(numel * dtype.itemsize)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (its shape and dtype) in a new file, mapped."""
        out = self.zeros(t.numel(), t.dtype)
        out.copy_(t.reshape(-1))
        return out.view(t.shape)

    def close(self) -> None:
        """Remove the directory (the tensors mapped from it stay readable while alive)."""
        shutil.rmtree(self.root, ignore_errors=True)
