"""FlatUnit: a group of parameters living as views of one flat buffer, sharded over DP.

A unit is what ZeRO communicates as one: a gradient bucket (stages 0-2) or the
parameters of one module (stage 3). Its ``padded`` elements are split into
``dp`` equal contiguous shards; DP rank ``r`` owns ``[r * S, (r + 1) * S)``.
Padding (at the end) keeps the shards equal so every collective is a plain
reduce-scatter or all-gather.

[Note: pieces keep the temporaries constant]
A unit may be larger than a communication bucket (one big embedding). Its
collectives then run in pieces: piece ``k`` is columns ``[k * c, (k + 1) * c)``
of every rank's shard, staged through a temporary of ``dp * c <= bucket``
elements. So no temporary communication buffer ever exceeds the bucket size,
whatever the model size. A unit that fits runs in one piece and, where both
sides are permanent flat buffers, in place with no temporary at all.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn

from hybrid.parallel.comm import CommGroup


class ShardHome(Protocol):
    """What a unit asks of the home its parameter shard lives in between gathers (stage 3
    ``--offload-param``). The whole contract, with what the host step writes through, is
    :class:`hybrid.zero.offload.contracts.ParamHome`."""

    def prefetch(self) -> None:
        """Start bringing the shard nearer (a read ahead); no-op if under way."""

    def load_into(self, shard: torch.Tensor) -> None:
        """``shard`` (on the device) <- the shard's values, for a gather."""

    def values(self) -> torch.Tensor:
        """The shard as it is now, in host memory (for reading)."""

    def store(self, values: torch.Tensor) -> Stored | None:
        """The whole shard <- ``values``; returns what ends with its write (None: done)."""


class Stored(Protocol):
    """A write to a home under way: ``synchronize()`` waits for it."""

    def synchronize(self) -> None: ...


class Pending(Protocol):
    """A collective under way (a gather, a reduction): ``wait()`` completes it."""

    def wait(self) -> None: ...


class Gathers(Protocol):
    """What a unit asks of the pipeline its gathers run through
    (:class:`~hybrid.zero.gather_pipeline.GatherPipeline`, which imports this module):
    every rank of ``dp``'s ``shard`` into ``full``, the unit's own group."""

    def start(self, full: torch.Tensor, shard: torch.Tensor, dp: CommGroup) -> Pending: ...


class ParamState(enum.Enum):
    """Where a unit's parameters are whole ([Note: a unit owns its states])."""

    WHOLE = "whole"  # never partitioned: ``full`` is the parameters' storage for good
    SHARDED = "sharded"  # partitioned, ``full``'s storage freed; the shard (or its home) kept
    GATHERING = "gathering"  # an all-gather into ``full`` is in flight
    GATHERED = "gathered"  # ``full`` holds every rank's shard: the module may run


class GradState(enum.Enum):
    """Where a unit's reduced gradient shard is on the device."""

    FLAT = "flat"  # views of the engine's flat gradient buffer, for the life of the unit
    LANDED = "landed"  # a landing buffer, lent while its reduction runs (offload, stages 2-3)
    AWAY = "away"  # none on the device (not bound yet, or gone down to the host step)


# [Note: a unit owns its states]
# A unit's parameter and gradient storage change under it as a step goes: stage 3
# frees and re-gathers ``full``, parameter offload keeps the shard in a home, an
# offloaded optimizer lends the gradient shard a landing buffer only while it is
# reduced. Those transitions are the unit's own methods, each checking the state it
# starts from, and the fields they change are read-only outside: the engine, the
# reducer, the gatherer and the landing call a verb (FSDP2's FSDPParam owns its
# sharded state the same way), so no module writes a field another one reads.


class FlatUnit:
    """Parameters ``params`` laid out back to back; see the module notes.

    Attributes:
        offsets: start of each parameter in unit coordinates.
        padded, shard_size (S): padded length and per-rank shard length.
        own_lo, own_hi: this rank's shard in unit coordinates.
        deferred: reduced once backward has finished, not from hooks (its parameters
            are used in several places: see :mod:`hybrid.zero.units`).
        full: ``(padded,)`` model-dtype buffer the parameters are views of.
        shard: this rank's slice ``full[own_lo:own_hi]`` of the parameters; a view,
            or, when parameters are partitioned (stage 3), a tensor of its own
            while ``full``'s storage is freed between uses.
        state, grad_state: see :class:`ParamState`, :class:`GradState`.
        grad_full, grad_shard: the gradient views (``grad_full`` only at stages 0-1).
        home: where the shard lives between gathers under parameter offload.
    """

    def __init__(self, params: list[nn.Parameter], dp_group: CommGroup, *,
                 partition_params: bool = False, owns_all: bool = False,
                 deferred: bool = False, name: str = ""):
        self.params = params
        self.name = name
        self.dp = dp_group
        self.partition_params = partition_params
        self.deferred = deferred
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.padded = -(-total // dp_group.size) * dp_group.size
        self.shard_size = self.padded // dp_group.size
        # Stage 0 keeps everything: this rank "owns" the whole unit for the optimizer.
        self.own_lo = 0 if owns_all else dp_group.rank * self.shard_size
        self.own_hi = self.padded if owns_all else self.own_lo + self.shard_size
        # ``full`` and ``shard`` are set by :meth:`bind`, before anything reads them
        self.full: torch.Tensor
        self.shard: torch.Tensor
        self._state = ParamState.SHARDED if partition_params else ParamState.WHOLE
        self._pending: Pending | None = None  # the gather in flight (GATHERING)
        self._home: ShardHome | None = None
        self._grad_state = GradState.AWAY
        self._grad_full: torch.Tensor | None = None
        self._grad_shard: torch.Tensor | None = None

    @property
    def state(self) -> ParamState:
        return self._state

    @property
    def gathered(self) -> bool:
        """The parameters are whole now (a whole unit always is)."""
        return self._state in (ParamState.WHOLE, ParamState.GATHERED)

    @property
    def home(self) -> ShardHome | None:
        """Where the shard lives between gathers (stage 3 parameter offload,
        hybrid/zero/offload/homes.py); None: on the device, in ``shard``."""
        return self._home

    @property
    def grad_state(self) -> GradState:
        return self._grad_state

    @property
    def grad_full(self) -> torch.Tensor | None:
        """Stages 0-1: the unit's whole gradient, a view of the flat gradient buffer."""
        return self._grad_full

    @property
    def grad_shard(self) -> torch.Tensor | None:
        """This rank's summed gradient (None: none on the device, :class:`GradState`)."""
        return self._grad_shard

    # -- layout -------------------------------------------------------------
    def segments(self, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
        """(param index, param-local start, unit start, length) overlapping unit range [lo, hi)."""
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                yield i, a - off, a, b - a

    def bind(self, full: torch.Tensor,
             fill: Callable[[int, int, int, torch.Tensor], None]) -> None:
        """Make ``full`` (``(padded,)``, model dtype) the parameters' storage.

        ``fill(i, lo, hi, dst)`` writes elements ``[lo, hi)`` of parameter ``i``
        (TP-local, flattened) into ``dst``. A unit whose parameters are
        partitioned (stage 3) fills only this rank's shard and frees ``full`` at
        once: no rank ever holds the unit whole outside a gather. Parameters on
        the meta device become real tensors here (same Python objects).
        """
        assert full.numel() == self.padded
        self.full = full
        views = [full[off: off + p.numel()].view_as(p) for p, off in zip(self.params, self.offsets)]
        with torch.no_grad():
            if self.partition_params:
                self.shard = torch.zeros(self.shard_size, dtype=full.dtype, device=full.device)
                for i, plo, ulo, n in self.segments(self.own_lo, self.own_hi):
                    a = ulo - self.own_lo
                    fill(i, plo, plo + n, self.shard[a: a + n])
                full.untyped_storage().resize_(0)
                self._state = ParamState.SHARDED
            else:
                full[self.numel:].zero_()
                for i, v in enumerate(views):
                    fill(i, 0, v.numel(), v.view(-1))
                self.shard = full[self.own_lo: self.own_hi]
        for p, v in zip(self.params, views):
            _rebind(p, v)

    # -- gradients: bound for good, or lent a landing buffer ------------------------
    def bind_grads(self, shard: torch.Tensor, full: torch.Tensor | None = None,
                   param_views: bool = False) -> None:
        """Make ``shard`` (and at stages 0-1 ``full``) the unit's gradient for good: views
        of the engine's flat gradient buffer. ``param_views``: the parameters' ``.grad``
        become views of ``full`` too (autograd then accumulates straight into it)."""
        assert self._grad_state is GradState.AWAY, (self.name, self._grad_state)
        self._grad_full, self._grad_shard = full, shard
        self._grad_state = GradState.FLAT
        if param_views:
            assert full is not None
            for p, o in zip(self.params, self.offsets):
                p.grad = full[o: o + p.numel()].view_as(p)

    def land_grads(self, shard: torch.Tensor) -> None:
        """A landing buffer (holding the unit's sum so far) is the gradient shard while
        the unit's reduction runs."""
        assert self._grad_state is GradState.AWAY, (self.name, self._grad_state)
        self._grad_shard, self._grad_state = shard, GradState.LANDED

    def release_grads(self) -> None:
        """The landing buffer goes back (its shard went down): no gradient on the device."""
        assert self._grad_state is GradState.LANDED, (self.name, self._grad_state)
        self._grad_shard, self._grad_state = None, GradState.AWAY

    def copy_grads(self, lo: int, hi: int, dst: torch.Tensor) -> None:
        """Copy unit range [lo, hi) of the params' ``.grad`` into ``dst`` (converting to
        its dtype; zeros in padding and for params without a gradient)."""
        dst.zero_()
        for i, plo, ulo, n in self.segments(lo, hi):
            src = self.params[i].grad
            if src is not None:
                dst[ulo - lo: ulo - lo + n].copy_(src.reshape(-1)[plo: plo + n])

    # -- stage 3: free and restore the full parameters -------------------------
    def offload_to(self, home: ShardHome) -> None:
        """From now on ``home`` keeps this rank's shard; the device holds it only while
        a gather runs (``shard`` keeps its dtype and size, its storage is freed)."""
        assert self._state is ParamState.SHARDED, (self.name, self._state)
        self._home = home
        self.shard.untyped_storage().resize_(0)

    def shard_values(self) -> torch.Tensor:
        """This rank's shard as it is now: ``shard``, or under parameter offload its
        home's values (host memory; a read for the disk tier). For reading only."""
        return self.shard if self._home is None else self._home.values()

    @torch.no_grad()
    def write_shard(self, values: torch.Tensor) -> None:
        """This rank's shard <- ``values`` (``shard_size`` elements, any device), where it
        lives: ``shard``, or under parameter offload its home (written through, waited
        for; the device keeps nothing). For a unit no optimizer writes (a frozen unit:
        hybrid/zero/units.py, [Note: frozen units]). A gathered unit's ``full`` is the
        caller's to write too."""
        assert self._state is not ParamState.GATHERING, self.name
        assert values.numel() == self.shard_size, (self.name, values.numel(), self.shard_size)
        if self._home is None:
            self.shard.copy_(values)
            return
        done = self._home.store(values.to(self.shard.dtype))
        if done is not None:
            done.synchronize()

    def release(self) -> None:
        """Free the full parameters' memory; the views stay (FSDP's storage-resize trick).
        A no-op unless they are gathered (a whole unit never is released)."""
        if self._state is ParamState.GATHERED:
            self.full.untyped_storage().resize_(0)
            self._state = ParamState.SHARDED

    def start_gather(self, pipe: Gathers) -> None:
        """All-gather the shards into ``full`` through ``pipe`` (a
        :class:`~hybrid.zero.gather_pipeline.GatherPipeline`), asynchronously;
        ``finish_gather`` completes it."""
        if self._state is not ParamState.SHARDED:  # (whole, gathered or under way)
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.padded * self.full.element_size())
        if self._home is not None:  # the shard comes back from its home for the gather
            self.shard.untyped_storage().resize_(self.shard_size * self.shard.element_size())
            self._home.load_into(self.shard)
        self._pending = pipe.start(self.full, self.shard, self.dp)
        self._state = ParamState.GATHERING

    def finish_gather(self, pipe: Gathers) -> None:
        """The parameters are whole on return (a gather under way is waited for, one not
        started is started first)."""
        if self.gathered:
            return
        if self._state is ParamState.SHARDED:
            self.start_gather(pipe)
        assert self._pending is not None, (self.name, self._state)  # (GATHERING)
        self._pending.wait()
        self._pending = None
        self._state = ParamState.GATHERED
        if self._home is not None:  # (ordered after the gather's reads of it)
            self.shard.untyped_storage().resize_(0)


def _rebind(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` the data of ``p``, keeping the Parameter object (its hooks, its
    attributes such as ``tp_spec``, every module slot that holds it)."""
    if p.is_meta:  # .data cannot change the device: swap the whole tensor in place
        new = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                           requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, new)
    # Through .data, not as a view: the parameter keeps a version counter of its
    # own, so the stage-3 gathers that rewrite the buffer in place do not look
    # like modifications of the tensors autograd saved in forward.
    p.data = view


def shard_bounds(units: list[FlatUnit]) -> list[int]:
    """Where each unit's owned part starts in the rank's flat shard (the parts back to
    back, in unit order), and the shard's length last."""
    out = [0]
    for u in units:
        out.append(out[-1] + u.own_hi - u.own_lo)
    return out


def piece_columns(shard_size: int, dp: int, bucket: int) -> int:
    """Columns per piece so that a staged piece (dp x columns) fits in ``bucket`` elements."""
    return max(1, min(shard_size, bucket // dp))
