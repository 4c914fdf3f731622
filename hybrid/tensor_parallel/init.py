"""Layout-independent initialization that can draw any slice of a parameter alone.

[Note: block-seeded init]
A parameter's *full* value (the whole tensor, before any TP split) is defined
element by element: flatten it row-major and cut it into fixed blocks of
``BLOCK`` elements; block ``b`` is drawn from a generator seeded by
``(seed, parameter name, b)``. So

* the value does not depend on the TP x DP layout, the ZeRO stage or the order
  modules were built in: every layout cuts the same full tensor;
* any slice can be drawn without drawing the rest: a rank materializes only
  what it keeps (its TP slice, and at ZeRO-3 only its DP shard of that), at a
  cost proportional to the slice, one bounded chunk at a time;
* the padded vocabulary rows (their number depends on TP) are zero, and the
  real rows do not move when the padding changes, since a row's flat position
  depends only on the row length.

A TP slice along ``dim`` is a column range of the full tensor seen as a 2-D
``(prod(shape[:dim]), prod(shape[dim:]))`` matrix (one row when ``dim`` is 0),
so a range of the TP-local tensor flattened is a set of runs, one per row.
Rows are drawn a bounded chunk at a time; for a split along ``dim >= 1`` the
whole row is drawn and this rank's columns kept (TP times the work of the
slice itself, never more memory than ``CHUNK`` elements).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybrid.tensor_parallel.sharding import local_block

BLOCK = 1 << 16  # elements per seeded block: part of the definition of the init
CHUNK = 1 << 22  # elements drawn at once: bounds the temporary memory


@dataclass(frozen=True)
class Init:
    """How one parameter's full value is drawn.

    ``kind``: "normal" (mean 0, ``std``), "zeros" or "ones". ``valid_rows``:
    only the first rows along dim 0 are drawn, the rest are zero (a padded
    vocabulary).
    """

    kind: str = "normal"
    std: float = 0.02
    valid_rows: int | None = None


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{name}|{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def draw_full_range(seed: int, name: str, init: Init, full_shape, lo: int,
                    hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the full tensor flattened, fp32 on the CPU."""
    if init.kind == "zeros":
        return torch.zeros(hi - lo)
    if init.kind == "ones":
        return torch.ones(hi - lo)
    if init.kind != "normal":
        raise ValueError(f"unknown init kind {init.kind!r} for {name}")
    out = torch.empty(hi - lo)
    g = torch.Generator(device="cpu")
    block = torch.empty(BLOCK)
    for b in range(lo // BLOCK, (hi - 1) // BLOCK + 1 if hi > lo else lo // BLOCK):
        g.manual_seed(_block_seed(seed, name, b))
        block.normal_(0.0, init.std, generator=g)
        a, z = max(lo, b * BLOCK), min(hi, (b + 1) * BLOCK)
        out[a - lo: z - lo] = block[a - b * BLOCK: z - b * BLOCK]
    if init.valid_rows is not None:
        row = math.prod(full_shape[1:])
        first_zero = max(0, init.valid_rows * row - lo)
        out[first_zero:] = 0.0
    return out


def local_values(seed: int, name: str, init: Init, param: torch.Tensor, lo: int,
                 hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of this rank's TP slice of ``param`` flattened, fp32 CPU.

    ``param`` may live on the meta device: only its shape and ``tp_spec`` are read (or,
    for an MoE layer's experts split over EP, ``ep_spec``: the same kind of slice).
    """
    spec = getattr(param, "tp_spec", None) or getattr(param, "ep_spec", None)
    shape = tuple(spec.full_shape) if spec is not None else tuple(param.shape)
    if spec is None:
        return draw_full_range(seed, name, init, shape, lo, hi)
    block = local_block(spec)  # (under ETP, experts: a block of rows, a column chunk)
    cols, width, base, row0 = block.cols, block.width, block.col0, block.row0
    if block.nrows == 1:
        start = row0 * cols + base
        return draw_full_range(seed, name, init, shape, start + lo, start + hi)
    out = torch.empty(hi - lo)
    if hi <= lo:
        return out
    first, last = lo // width, (hi - 1) // width  # (local rows)
    step = max(1, CHUNK // cols)
    for ra in range(first, last + 1, step):
        rb = min(last + 1, ra + step)
        span = draw_full_range(seed, name, init, shape, (row0 + ra) * cols,
                               (row0 + rb) * cols)
        mine = span.view(rb - ra, cols)[:, base: base + width].reshape(-1)
        a, z = max(lo, ra * width), min(hi, rb * width)
        out[a - lo: z - lo] = mine[a - ra * width: z - ra * width]
    return out


class InitValues:
    """``values(name, param, lo, hi)``: fp32 CPU values of a TP-local flat range.

    The value source ZeRO materializes a meta-device model from; ``init_of(name)``
    says how each parameter is drawn.
    """

    def __init__(self, seed: int, init_of: Callable[[str], Init]):
        self.seed, self.init_of = seed, init_of

    def __call__(self, name: str, param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return local_values(self.seed, name, self.init_of(name), param, lo, hi)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, init_of: Callable[[str], Init]) -> None:
    """Fill every (materialized) parameter of ``module`` with its TP slice, chunk by chunk."""
    values = InitValues(seed, init_of)
    for name, p in module.named_parameters():
        flat = p.view(-1)
        for lo in range(0, flat.numel(), CHUNK):
            hi = min(flat.numel(), lo + CHUNK)
            flat[lo:hi].copy_(values(name, p, lo, hi))
