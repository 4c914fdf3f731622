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


class FlatUnit:
    """Parameters ``params`` laid out back to back; see the module note.

    Attributes:
        offsets: start of each parameter in unit coordinates.
        padded, shard_size (S): padded length and per-rank shard length.
        own_lo, own_hi: this rank's shard in unit coordinates.
        full: ``(padded,)`` model-dtype buffer the parameters are views of.
        shard: this rank's slice ``full[own_lo:own_hi]`` of the parameters; a view,
            or, when parameters are partitioned (stage 3), a tensor of its own
            while ``full``'s storage is freed between uses.
    """

    def __init__(self, params: list[nn.Parameter], dp_group: CommGroup,
                 partition_params: bool = False, owns_all: bool = False, name: str = ""):
        self.params = params
        self.name = name
        self.dp = dp_group
        self.partition_params = partition_params
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
        # Reduced at the end of backward rather than from hooks: its parameters are
        # used in several places, so no hook can tell when their gradients are whole.
        self.deferred = False
        self.grad_full: torch.Tensor | None = None  # stages 0, 1: view of the flat grads
        self.grad_shard: torch.Tensor | None = None  # this rank's summed gradient
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
        self.gathered = True
        self.pending = None  # in-flight async gather: (work, staged pieces)
        # stage 3 parameter offload: where the shard lives between gathers
        # (hybrid/zero/offload/homes.py); None: on the device, in ``shard``
        self.home: ShardHome | None = None

    # -- layout -------------------------------------------------------------
    def segments(self, lo: int, hi: int):
        """(param index, param-local start, unit start, length) overlapping unit range [lo, hi)."""
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                yield i, a - off, a, b - a

    def bind(self, full: torch.Tensor, fill) -> None:
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
                self.gathered = False
            else:
                full[self.numel:].zero_()
                for i, v in enumerate(views):
                    fill(i, 0, v.numel(), v.view(-1))
                self.shard = full[self.own_lo: self.own_hi]
        for p, v in zip(self.params, views):
            _rebind(p, v)

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
        assert self.partition_params and not self.gathered
        self.home = home
        self.shard.untyped_storage().resize_(0)

    def shard_values(self) -> torch.Tensor:
        """This rank's shard as it is now: ``shard``, or under parameter offload its
        home's values (host memory; a read for the disk tier). For reading only."""
        return self.shard if self.home is None else self.home.values()

    def release(self) -> None:
        """Free the full parameters' memory; the views stay (FSDP's storage-resize trick)."""
        if self.partition_params and self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def start_gather(self, pipe) -> None:
        """All-gather the shards into ``full`` through ``pipe`` (a
        :class:`~hybrid.zero.gather_pipeline.GatherPipeline`), asynchronously;
        ``finish_gather`` completes it."""
        if self.gathered or self.pending is not None:
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.padded * self.full.element_size())
        if self.home is not None:  # the shard comes back from its home for the gather
            self.shard.untyped_storage().resize_(self.shard_size * self.shard.element_size())
            self.home.load_into(self.shard)
        self.pending = pipe.start(self.full, self.shard)

    def finish_gather(self, pipe) -> None:
        if self.gathered:
            return
        if self.pending is None:
            self.start_gather(pipe)
        self.pending.wait()
        self.pending = None
        self.gathered = True
        if self.home is not None:  # (ordered after the gather's reads of it)
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
