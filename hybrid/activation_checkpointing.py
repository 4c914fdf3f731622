"""ZeRO-R: activation checkpointing, partitioned across the TP group, optionally on the host.

    ac = apply_activation_checkpointing(model, ps, rng, cfg.recompute)  # after building the model
    loss = model(tokens, labels); loss.backward()              # as before
    ac.peak_bytes(); ac.reset_peak(); ac.allocations           # what the metrics read

Each of the first ``cfg.num_layers`` blocks of ``model.blocks`` (all
by default) keeps only its *input* ``(B, T, C)`` during the forward pass and
runs itself again, with a graph, during backward.

Under Megatron tensor parallelism every TP rank holds the same copy of a
block's input (the residual stream is replicated), so storing it whole on each
rank is TP-fold redundant. With ``--partition-activations`` each TP rank keeps
only chunk ``tp_rank`` of the flattened input, padded to ``ceil(numel / TP)``
elements, and the chunks are all-gathered over ``ps.tp_group`` into one gather
buffer right before the recompute. ``--cpu-checkpointing`` keeps the stored
chunks in host memory (pinned when the device is CUDA) and copies them back to
the device before the gather; on a CPU-only machine the copy goes to a separate
host buffer, so the same path runs. ``--contiguous-checkpointing`` writes the
chunks into one preallocated buffer with one slot per checkpointed block.

[Note: recompute re-enters the block's __call__]
The wrapper is installed as the block's ``forward`` *instance attribute*: not a
submodule, so parameter names, ``state_dict`` keys and the name-seeded init are
unchanged. In backward the recompute calls ``block(x)`` -- ``Module.__call__``
-- so forward hooks on the block and its submodules fire again; ZeRO-3's
pre-forward hook gathers the block's parameters there (the backward gather of
its 3 Psi budget) and its post-forward hook keeps them, because the recompute
runs inside ``phase.recomputing()`` (:class:`hybrid.phase.RecomputePhase`, the
explicit signal shared with ZeRO). A per-block flag routes that re-entered
``forward`` straight to the block's own code.

[Note: RNG in recompute]
Dropout in the recomputed block must draw the masks of the forward pass. The
forward records the CPU generator, the CUDA generator of the device (on CUDA)
and the TP tracker's states (:meth:`TPRNGTracker.get_states`) it started from;
the recompute sets them, runs, and puts back the states of "now", so the rest
of backward and the next step draw exactly what they would without
checkpointing. The autocast state of the forward is replayed the same way.

[Note: buffer lifetimes]
The gather and staging buffers are shared by every block and allocated once
(again only for a larger micro-batch). A restored input is a view of them and
the recompute graph saves it (LayerNorm's input); that is safe because one
block's recompute *and* backward finish inside its ``backward`` before the
next block restores. A contiguous slot is written in forward and read in the
same step's backward; if it is still held (two forwards before one backward),
the new checkpoint gets a tensor of its own instead of overwriting it. Padding
elements of a chunk are never written: they land past ``numel`` in the gather
buffer and are sliced off.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from hybrid.config_sections import RecomputeConfig
from hybrid.parallel_state import ParallelState
from hybrid.phase import RecomputePhase
from hybrid.tensor_parallel import TPRNGTracker

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
            if not in_slot:
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


class _ForwardState:
    """What a block's forward drew from besides its input and parameters:
    the CPU, device and TP-tracker RNG states, and the autocast setting."""

    def __init__(self, device: torch.device, tracker: TPRNGTracker | None):
        self.device, self.tracker = device, tracker
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.tracked = tracker.get_states() if tracker is not None else None
        self.autocast = (torch.is_autocast_enabled(device.type),
                         torch.get_autocast_dtype(device.type))

    def restore_rng(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        if self.tracked is not None:
            self.tracker.set_states(self.tracked)

    def autocast_context(self):
        enabled, dtype = self.autocast
        return torch.autocast(self.device.type, dtype=dtype, enabled=enabled)


class _CheckpointedForward:
    """Stands in for ``block.forward``: one tensor in ``(B, T, C)``, one tensor out.

    Under ``no_grad`` (evaluation) or while recomputing it runs the block's own
    forward; otherwise it goes through :class:`_Recompute`.
    """

    def __init__(self, block: nn.Module, store: CheckpointStore, slot: int,
                 rng: TPRNGTracker | None, phase: RecomputePhase):
        if "forward" in vars(block):
            raise ValueError(f"{type(block).__name__} already has an instance-level forward "
                             f"(activation checkpointing applied twice?)")
        self._block = weakref.ref(block)  # no block -> wrapper -> block cycle
        self._inner = type(block).forward
        self.store, self.slot, self.rng, self.phase = store, slot, rng, phase
        self.recomputing = False
        # Makes the output require grad when the input does not, so backward
        # still reaches this block's parameters.
        self._anchor = torch.empty(0, requires_grad=True)

    @property
    def block(self) -> nn.Module:
        return self._block()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.recomputing or not torch.is_grad_enabled():
            return self._inner(self.block, x)
        anchor = () if x.requires_grad else (self._anchor,)
        return _Recompute.apply(self, x, *anchor)

    def recompute(self, x: torch.Tensor) -> torch.Tensor:
        """``block(x)`` through ``Module.__call__``, so every module hook fires again."""
        self.recomputing = True
        try:
            with self.phase.recomputing():
                return self.block(x)
        finally:
            self.recomputing = False


class _Recompute(torch.autograd.Function):
    """forward: stash the block input (partitioned / on the host), run the block without a graph.
    backward: restore the input (all-gather over the TP group when partitioned) and the
    forward's RNG, rerun the block with a graph, backpropagate ``dy`` through it.

    Parameter gradients reach ``param.grad`` through that inner backward, so
    post-accumulate-grad hooks (ZeRO's reductions) fire as usual.
    """

    @staticmethod
    def forward(ctx, fwd: _CheckpointedForward, x: torch.Tensor, *anchor):
        ctx.fwd, ctx.n_anchor, ctx.x_requires_grad = fwd, len(anchor), x.requires_grad
        ctx.state = _ForwardState(x.device, fwd.rng)
        ctx.stash = fwd.store.stash(fwd.slot, x)
        return fwd._inner(fwd.block, x)  # grad mode is off inside Function.forward

    @staticmethod
    def backward(ctx, dy):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("activation checkpointing supports loss.backward(), not "
                               "torch.autograd.grad(...) or backward(inputs=...)")
        fwd, stash = ctx.fwd, ctx.stash
        ctx.stash = None
        x = fwd.store.restore(stash).detach().requires_grad_(ctx.x_requires_grad)
        now = _ForwardState(x.device, fwd.rng)
        ctx.state.restore_rng()
        try:
            with torch.enable_grad(), ctx.state.autocast_context():
                y = fwd.recompute(x)
        finally:
            now.restore_rng()
        if y.requires_grad:
            torch.autograd.backward(y, dy)
        return (None, x.grad if ctx.x_requires_grad else None) + (None,) * ctx.n_anchor


class ActivationCheckpointing:
    """Handle returned by :func:`apply_activation_checkpointing`: bytes and counters.

    Bytes are this rank's (with partitioning, its 1/TP chunks).
    """

    def __init__(self, store: CheckpointStore, wrappers: list[_CheckpointedForward],
                 phase: RecomputePhase):
        self.store, self._wrappers = store, wrappers
        self.phase = phase  # set during every recompute; give it to apply_zero

    @property
    def blocks(self) -> list[nn.Module]:
        """The checkpointed blocks, in order."""
        return [w.block for w in self._wrappers]

    def stored_bytes(self) -> int:
        """Checkpoint bytes held now (between a forward and its backward)."""
        return self.store.stored_bytes()

    def peak_bytes(self) -> int:
        """Most checkpoint bytes held at once since the last :meth:`reset_peak`."""
        return self.store.peak_bytes()

    def reset_peak(self) -> None:
        self.store.reset_peak()

    def buffer_bytes(self) -> int:
        """Long-lived buffers: gather, staging, contiguous slots (allocated once)."""
        return self.store.buffer_bytes()

    @property
    def allocations(self) -> dict:
        """Buffer allocations so far, by kind (see :class:`CheckpointStore`)."""
        return dict(self.store.allocations)

    def remove(self) -> None:
        """Give the blocks their own forward back (checkpoints held so far stay valid)."""
        for w in self._wrappers:
            if w.block is not None and vars(w.block).get("forward") is w:
                del w.block.forward


def apply_activation_checkpointing(model: nn.Module, ps: ParallelState,
                                   rng: TPRNGTracker | None, cfg: RecomputeConfig,
                                   blocks: list[nn.Module] | None = None,
                                   phase: RecomputePhase | None = None
                                   ) -> ActivationCheckpointing:
    """Checkpoint ``blocks`` (default: ``model.blocks[:cfg.num_layers]``, all when
    that is None) in place, following ``cfg.partition_activations``,
    ``cfg.cpu_checkpointing`` and ``cfg.contiguous_checkpointing``.

    Each block must map one tensor ``(B, T, C)``, replicated over ``ps.tp_group``,
    to one tensor. ``rng`` is the tracker whose states the recompute replays.
    ``phase`` is set around every recompute (a new one if not given; it is
    ``handle.phase``): pass the same object to ``apply_zero(..., recompute=)``.
    Names of parameters and ``state_dict`` keys do not change; apply before or
    after ZeRO.
    """
    if blocks is None:
        blocks = list(model.blocks)[: cfg.num_layers or len(model.blocks)]
    phase = phase or RecomputePhase()
    store = CheckpointStore(ps, cfg.partition_activations, cfg.cpu_checkpointing,
                            cfg.contiguous_checkpointing, len(blocks))
    wrappers = [_CheckpointedForward(b, store, slot, rng, phase)
                for slot, b in enumerate(blocks)]
    for b, w in zip(blocks, wrappers):
        b.forward = w  # instance attribute, not a submodule: names stay
    return ActivationCheckpointing(store, wrappers, phase)
