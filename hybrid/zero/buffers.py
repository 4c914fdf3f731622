"""The engine's flat buffers of fp32 master weights and of gradients, one rank's worth.

Both are flat tensors over units laid out back to back, with per-unit views:
no per-parameter allocation in a step, and the optimizer's kernels may run
over the whole shard in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import torch

from hybrid.config.sections import OffloadConfig
from hybrid.zero.flat_unit import FlatUnit
from hybrid.zero.units import FlatFill, Materializer, OwnedPiece


class _States(Protocol):
    def fill(self, master_values: FlatFill) -> None: ...


_S = TypeVar("_S", bound=_States)
_S_co = TypeVar("_S_co", bound=_States, covariant=True)


class MasterTiers(Protocol[_S_co]):
    """What the master's allocation asks of the offload tiers
    (:class:`~hybrid.zero.offload.tiers.OffloadTiers`; the core does not import offload):
    whether host buffers are pinned, and the nvme tier's optimizer states (None: not
    that tier), which the master is filled into."""

    @property
    def pin(self) -> bool: ...

    @property
    def states(self) -> _S_co | None: ...


def allocate_master(units: list[FlatUnit], pieces: Sequence[OwnedPiece], fill: Materializer,
                    *, offload: OffloadConfig, tiers: MasterTiers[_S], device: torch.device | None
                    ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None, _S | None]:
    """(flat fp32 master, its per-unit views, the nvme tier's swapped states).

    ``device`` None: no separate master (the fp32, on-device parameter shards are
    their own): all three None. With ``offload.optimizer`` the master lives on
    the host (pinned as ``tiers.pin`` says), or on the nvme tier in ``tiers.states``
    (returned third, filled here; the first two None). ``pieces``: the engine's
    owned pieces, whose exact fp32 values ``fill`` writes -- before the model's
    parameters become low-precision views and lose them.
    """
    if device is None:
        return None, None, None
    if offload.optimizer == "nvme":
        assert tiers.states is not None  # (the tiers hold the nvme tier's states)
        tiers.states.fill(fill.flat_filler(pieces, units))
        return None, None, tiers.states
    on_host = offload.optimizer is not None
    flat = torch.empty(sum(u.own_hi - u.own_lo for u in units), dtype=torch.float32,
                       device=torch.device("cpu") if on_host else device,
                       pin_memory=on_host and tiers.pin)
    master, off = [], 0
    for u in units:
        master.append(flat[off: off + u.own_hi - u.own_lo])
        off += u.own_hi - u.own_lo
    flat.zero_()  # (the padding stays zero)
    for pc in pieces:  # the exact fp32 values of every owned piece
        fill.fill(pc.param, pc.lo, pc.hi, master[pc.unit][pc.part])
    return flat, master, None


def allocate_grads(units: list[FlatUnit], *, sharded: bool, dtype: torch.dtype,
                   grad_dtype: torch.dtype, device: torch.device,
                   lands: bool) -> torch.Tensor | None:
    """The flat gradient buffer in ``grad_dtype``, with each unit's views set.

    ``sharded`` False (stages 0-1): full gradients, ``unit.grad_full`` views (and
    ``param.grad`` views too when ``dtype`` is the gradient dtype: autograd then
    accumulates straight into the buffer). ``sharded``: this rank's shard of each
    unit only, ``unit.grad_shard``. ``lands``: None, no buffer -- the shards land
    in :class:`~hybrid.zero.offload.landing.GradLanding`'s buffers.
    """
    if lands:
        return None
    if not sharded:
        flat = torch.zeros(sum(u.padded for u in units), dtype=grad_dtype, device=device)
        off = 0
        for u in units:
            full = flat[off: off + u.padded]
            u.bind_grads(full[u.own_lo: u.own_hi], full, param_views=grad_dtype == dtype)
            off += u.padded
        return flat
    flat = torch.zeros(sum(u.own_hi - u.own_lo for u in units), dtype=grad_dtype, device=device)
    off = 0
    for u in units:
        n = u.own_hi - u.own_lo
        u.bind_grads(flat[off: off + n])
        off += n
    return flat
