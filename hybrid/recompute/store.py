"""Where activation checkpoints live: this rank's share of each stored block input.

    store = CheckpointStore(ps, partition, cpu, contiguous, num_slots)
    s = store.stash(slot, x)      # forward: keep this rank's share of x (B, T, C)
    x = store.restore(s)          # backward: the whole x again, on ps.device

Used by :mod:`hybrid.recompute.checkpointing`, one slot per checkpoint group.

[Note: buffer lifetimes]
The gather and staging buffers are shared by every checkpoint and allocated
once (again only for a larger micro-batch). A restored input is a view of them
and the recompute graph saves it (LayerNorm's input); that is safe because one
group's recompute *and* backward finish inside its ``backward`` before the
next group restores. A contiguous slot is written in forward and read in the
same step's backward; if it is still held (two forwards before one backward),
the new checkpoint gets a tensor of its own instead of overwriting it. Padding
elements of a chunk are never written: they land past ``numel`` in the gather
buffer and are sliced off.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hybrid.parallel.state import ParallelState

_ALIGN = 64  # bytes; slot offsets stay aligned for a .view() as any dtype

ALLOCATION_KINDS = ("gather", "staging", "contiguous", "tensor")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _Reusable:
    """One byte buffer that grows to the largest request and is reused otherwise."""

    def __init__(self, kind: str, device: torch.device, counts: dict, pin: bool = False):
        self.kind, self.device, self.counts, self.pin = kind, device, counts, pin
        self.buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` bytes at the start of the buffer."""
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None  # let the smaller one go first (unless a stash still views it)
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device,
                                   pin_memory=self.pin)
            self.counts[self.kind] += 1
        return self.buf[:nbytes]

    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()


@dataclass(eq=False)  # identity hash: lives in a WeakSet
class _Stash:
    """One stored checkpoint: this rank's chunk (or the whole input) and how to rebuild it."""

    held: torch.Tensor | None  # None once restored
    shape: torch.Size
    numel: int  # of the full input
    nbytes: int  # of ``held``
    version: int | None  # input's version counter when ``held`` is the input itself


class CheckpointStore:
    """Owner of every checkpoint buffer of one model; reports bytes and allocations.

    ``stash`` keeps this rank's share of a block input, ``restore`` rebuilds the
    full input on ``ps.device`` (all-gathering over ``ps.tp_group`` when
    partitioned). ``allocations`` counts buffer allocations by kind: "gather"
    (the TP gather buffer), "staging" (a host chunk's copy back on the device),
    "contiguous" (the slot buffer), "tensor" (one per stored checkpoint when not
    contiguous -- the fragmentation contiguous mode removes). Plain recompute
    on the device keeps a reference to the input itself and allocates nothing.
    """

    def __init__(self, ps: ParallelState, partition: bool, cpu: bool, contiguous: bool,
                 num_slots: int):
        self.ps = ps
        self.partition = partition and ps.tp_size > 1  # nothing to split at TP 1
        self.cpu, self.contiguous, self.num_slots = cpu, contiguous, num_slots
        self.home = torch.device("cpu") if cpu else ps.device
        self.pin = cpu and ps.device.type == "cuda"  # async host<->device copies
        self.allocations = dict.fromkeys(ALLOCATION_KINDS, 0)
        self._gather = _Reusable("gather", ps.device, self.allocations)
        self._staging = _Reusable("staging", ps.device, self.allocations)
        self._slots: torch.Tensor | None = None
        self._slot_stride = 0  # bytes per slot in ``_slots``
        self._slot_user: list = [None] * num_slots  # weakref to the stash in each slot
        self._live: weakref.WeakSet = weakref.WeakSet()  # stashes not yet restored
        self._peak = 0

    # -- accounting ------------------------------------------------------------
    def stored_bytes(self) -> int:
        """Bytes of checkpoints stored and not yet restored (dropped stashes excluded)."""
        return sum(s.nbytes for s in list(self._live))

    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self.stored_bytes()

    def buffer_bytes(self) -> int:
        """Bytes of the long-lived buffers: gather, staging and the contiguous slots."""
        slots = 0 if self._slots is None else self._slots.numel()
        return self._gather.nbytes() + self._staging.nbytes() + slots

    # -- storage ---------------------------------------------------------------
    def _slot(self, slot: int, nbytes: int) -> torch.Tensor | None:
        """Bytes for ``slot`` in the contiguous buffer; None while that slot is still held."""
        user = self._slot_user[slot]
        if user is not None and user() is not None and user().held is not None:
            return None
        if self._slots is None or self._slot_stride < nbytes:
            # A larger micro-batch: one new buffer for all slots. Stashes still
            # viewing the old one keep it alive until they are restored.
            self._slot_stride = _aligned(nbytes)
            self._slots = None
            self._slots = torch.empty(self.num_slots * self._slot_stride, dtype=torch.uint8,
                                      device=self.home, pin_memory=self.pin)
            self.allocations["contiguous"] += 1
        lo = slot * self._slot_stride
        return self._slots[lo: lo + nbytes]

    @torch.no_grad()
    def stash(self, slot: int, x: torch.Tensor) -> _Stash:
        """Keep this rank's share of ``x``: chunk ``tp_rank`` of ``ceil(numel / TP)``
        elements when partitioning, else all of it; on the host with ``cpu``."""
        flat = x.detach().reshape(-1)
        n, es = flat.numel(), flat.element_size()
        if not (self.partition or self.cpu or self.contiguous) and x.is_contiguous() \
                and x.untyped_storage().nbytes() == n * es:
            # Plain recompute: the input is alive until the next block has read
            # it anyway; holding it costs the same bytes as a copy, minus the copy.
            s = _Stash(flat, x.shape, n, n * es, x._version)  # a view of x
        else:
            piece = -(-n // self.ps.tp_size) if self.partition else n
            lo = min(n, self.ps.tp_rank * piece) if self.partition else 0
            src = flat[lo: min(n, lo + piece)]
            raw = self._slot(slot, piece * es) if self.contiguous else None
            in_slot = raw is not None
            if raw is None:
                raw = torch.empty(piece * es, dtype=torch.uint8, device=self.home,
                                  pin_memory=self.pin)
                self.allocations["tensor"] += 1
            held = raw.view(flat.dtype)
            held[: src.numel()].copy_(src, non_blocking=self.cpu)
            s = _Stash(held, x.shape, n, piece * es, None)
            if in_slot:
                self._slot_user[slot] = weakref.ref(s)
        self._live.add(s)
        self._peak = max(self._peak, self.stored_bytes())
        return s

    @torch.no_grad()
    def restore(self, s: _Stash) -> torch.Tensor:
        """The full input again, on ``ps.device``; releases the stash.

        Collective (partitioned): all-gather over ``ps.tp_group``, every TP rank
        restores the same block in the same order. The result is a view of a
        shared buffer, valid until the next ``restore`` (see [Note: buffer lifetimes]).
        """
        if s.held is None:
            raise RuntimeError("this checkpoint was already restored: a checkpointed block "
                               "supports one backward per forward (no retain_graph)")
        held, s.held = s.held, None
        self._live.discard(s)
        if s.version is not None and held._version != s.version:
            raise RuntimeError("the input of a checkpointed block was modified in place after "
                               "its forward; the recompute would see different values")
        piece, es = held, held.element_size()
        if self.cpu:  # back to the device before the gather
            staged = self._staging.get(held.numel() * es).view(held.dtype)
            staged.copy_(held, non_blocking=True)
            piece = staged
        if self.partition:
            out = self._gather.get(self.ps.tp_size * piece.numel() * es).view(held.dtype)
            self.ps.tp_group.all_gather(out, piece)
            piece = out
        return piece[: s.numel].view(s.shape)
