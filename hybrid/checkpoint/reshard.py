"""Rebuild full parameters (and Adam moments) from any layout's rank files.

See the resharding note in :mod:`hybrid.checkpoint.save`. Only one
parameter's full tensors are held at a time; the rank files are memory-mapped.
"""

from __future__ import annotations

import torch

from hybrid.errors import CheckpointError

KEYS = ("master", "exp_avg", "exp_avg_sq")


class FullParams:
    """``full(name, key)``: the full fp32 tensor of one parameter from its pieces.

    A TP-replicated parameter was saved once per TP rank; ``replica`` picks
    whose copy. Loading into the same TP size, each rank takes back its own.
    Training keeps the copies bit-identical (every TP rank reaches the same
    clip coefficient), but a copy that differed in the last bits -- a
    checkpoint from before that was so, or a non-deterministic kernel -- would
    otherwise make the resumed run drift from the uninterrupted one.
    """

    def __init__(self, rank_files: list[dict], where: str):
        self.where = where
        self.specs: dict[str, dict] = {}
        self.pieces: dict[str, list] = {}
        for rf in rank_files:
            for name, spec in rf["specs"].items():
                self.specs.setdefault(name, spec)
            for name, entry in rf["params"].items():
                spec = rf["specs"][name]
                # replicated pieces are filed under the TP rank that saved them
                slot = spec["tp_rank"] if spec["dim"] is not None else rf.get("tp_rank", 0)
                self.pieces.setdefault(name, []).append((slot, entry))
        self._cache_name, self._cache = None, {}

    def names(self) -> list[str]:
        return list(self.specs)

    def full(self, name: str, key: str, replica: int = 0) -> torch.Tensor:
        if name != self._cache_name:
            self._cache = self._assemble(name)
            self._cache_name = name
        t = self._cache[key]
        if isinstance(t, dict):  # replicated: one copy per saving TP rank
            return t[replica] if replica in t else t[min(t)]
        return t

    def _assemble(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.specs:
            raise CheckpointError(f"{self.where}: has no parameter {name!r}")
        spec = self.specs[name]
        if spec["dim"] is None:
            return self._assemble_replicated(name, list(spec["full_shape"]))
        shape, dim, tp = list(spec["full_shape"]), spec["dim"], spec["tp_size"]
        local_shape = list(shape)
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
        return {k: torch.cat([t.view(local_shape) for t in slices[k]], dim=dim) for k in KEYS}

    def _assemble_replicated(self, name: str, shape: list[int]) -> dict[str, dict]:
        """{key: {saving TP rank: full tensor}} for every complete copy."""
        n = 1
        for s in shape:
            n *= s
        copies: dict[int, dict] = {}
        for rep, entry in self.pieces.get(name, []):
            c = copies.setdefault(rep, {**{k: torch.zeros(n) for k in KEYS},
                                        "covered": torch.zeros(n, dtype=torch.bool)})
            off = 0
            for lo, hi in entry["ranges"]:
                for k in KEYS:
                    c[k][lo:hi] = entry[k][off: off + hi - lo]
                c["covered"][lo:hi] = True
                off += hi - lo
        complete = {r: c for r, c in copies.items() if c["covered"].all()}
        if not complete:
            raise CheckpointError(f"{self.where}: pieces of {name!r} are missing "
                                  f"(a rank file is incomplete)")
        return {k: {r: c[k].view(shape) for r, c in complete.items()} for k in KEYS}


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
