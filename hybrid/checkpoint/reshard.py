"""Rebuild full parameters (and Adam moments) from any layout's rank files.

See the resharding note in :mod:`hybrid.checkpoint.save`. Only one
parameter's full tensors are held at a time; the rank files are memory-mapped.
"""

from __future__ import annotations

import torch

from hybrid.errors import CheckpointError

KEYS = ("master", "exp_avg", "exp_avg_sq")


class FullParams:
    """``full(name, key)``: the full fp32 tensor of one parameter from its pieces."""

    def __init__(self, rank_files: list[dict], where: str):
        self.where = where
        self.specs: dict[str, dict] = {}
        self.pieces: dict[str, list] = {}
        for rf in rank_files:
            for name, spec in rf["specs"].items():
                self.specs.setdefault(name, spec)
            for name, entry in rf["params"].items():
                self.pieces.setdefault(name, []).append((rf["specs"][name]["tp_rank"], entry))
        self._cache_name, self._cache = None, {}

    def names(self) -> list[str]:
        return list(self.specs)

    def full(self, name: str, key: str) -> torch.Tensor:
        if name != self._cache_name:
            self._cache = self._assemble(name)
            self._cache_name = name
        return self._cache[key]

    def _assemble(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.specs:
            raise CheckpointError(f"{self.where}: has no parameter {name!r}")
        spec = self.specs[name]
        shape, dim, tp = list(spec["full_shape"]), spec["dim"], spec["tp_size"]
        local_shape = list(shape)
        if dim is not None:
            local_shape[dim] //= tp
        n_local = 1
        for s in local_shape:
            n_local *= s
        slices = {k: [torch.zeros(n_local) for _ in range(tp)] for k in KEYS}
        covered = [torch.zeros(n_local, dtype=torch.bool) for _ in range(tp)]
        for tp_rank, entry in self.pieces.get(name, []):
            off = 0
            for lo, hi in entry["ranges"]:
                for k in KEYS:
                    slices[k][tp_rank][lo:hi] = entry[k][off: off + hi - lo]
                covered[tp_rank][lo:hi] = True
                off += hi - lo
        if not all(c.all() for c in covered):
            raise CheckpointError(f"{self.where}: pieces of {name!r} are missing "
                                  f"(a rank file is incomplete)")
        out = {}
        for k in KEYS:
            parts = [t.view(local_shape) for t in slices[k]]
            out[k] = torch.cat(parts, dim=dim) if dim is not None else parts[0]
        return out


def fit_rows(full: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Cut or zero-pad dim 0 (the padded vocabulary) to ``shape``."""
    if list(full.shape) == list(shape):
        return full
    out = torch.zeros(shape, dtype=full.dtype)
    n = min(full.shape[0], shape[0])
    out[:n] = full[:n]
    return out


def merged_state(ckpt: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(metadata, {name: {"master", "exp_avg", "exp_avg_sq"}}) of a whole checkpoint, unsharded."""
    from hybrid.checkpoint.files import read_metadata, read_rank_files
    meta = read_metadata(ckpt)
    full = FullParams(read_rank_files(ckpt, meta["world_size"]), ckpt)
    return meta, {n: {k: full.full(n, k).clone() for k in KEYS} for n in full.names()}
