"""ZeRO-R: activation checkpointing, partitioned across the TP group, optionally on the host.

``apply_activation_checkpointing(model, ps, rng, cfg)`` makes each of the first
``--recompute-num-layers`` transformer blocks keep only its *input* during the
forward pass and recompute itself during backward.

Under Megatron tensor parallelism every TP rank holds the same copy of a
block's input (the residual stream is replicated), so storing it whole on each
rank is TP-fold redundant. With ``--partition-activations`` each TP rank keeps
only its ``1/TP`` slice of the flattened input (padded to a multiple of TP), and
the slices are all-gathered over the TP group, into one gather buffer
allocated once and reused by every layer, right before the recompute.
``--cpu-checkpointing`` keeps the stored slices in host memory (pinned on
CUDA); ``--contiguous-checkpointing`` puts them in one preallocated buffer with
a slot per layer instead of many small tensors.

[Note: RNG in recompute]
Dropout inside the recomputed block must draw the same masks as in the
forward pass. The forward records the CPU, device and TP-tracker RNG states it
started from; the recompute restores them, runs, then puts back the states
of "now" so the rest of backward is undisturbed.

Wrapping replaces the block's ``forward`` on the instance only, so parameter
names, ``state_dict`` and module hooks (ZeRO-3's gathers) are untouched: a
ZeRO-3 block is gathered for the recompute by the hook on its output's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import TPRNGTracker
from hybrid.tensor_parallel.random import get_device_rng_state, set_device_rng_state


@dataclass
class _Stashed:
    """One stored checkpoint: the held tensor and how to rebuild the full input."""

    held: torch.Tensor  # this rank's slice (or the whole input), maybe on the host
    shape: torch.Size
    numel: int
    nbytes: int


@dataclass
class CheckpointStore:
    """Owner of every checkpoint buffer; reports bytes and allocations.

    ``allocations`` counts buffer (re)allocations by kind: "gather" (the TP
    gather buffer), "staging" (device copy of a host slice before the gather),
    "contiguous" (the slot store), "tensor" (one per stored checkpoint when not
    contiguous: that is the fragmentation contiguous mode removes).
    """

    ps: ParallelState
    partition: bool
    cpu: bool
    contiguous: bool
    num_slots: int
    allocations: dict = field(default_factory=lambda: {"gather": 0, "staging": 0,
                                                        "contiguous": 0, "tensor": 0})
    stored_bytes: int = 0
    peak: int = 0
    _gather: torch.Tensor | None = None
    _staging: torch.Tensor | None = None
    _slots: torch.Tensor | None = None

    def _home(self) -> torch.device:
        return torch.device("cpu") if self.cpu else self.ps.device

    def _empty(self, n: int, dtype, device) -> torch.Tensor:
        pin = self.cpu and device.type == "cpu" and torch.cuda.is_available()
        return torch.empty(n, dtype=dtype, device=device, pin_memory=pin)

    def _piece_len(self, numel: int) -> int:
        tp = self.ps.tp_size if self.partition else 1
        return -(-numel // tp)

    @torch.no_grad()
    def stash(self, slot: int, x: torch.Tensor) -> _Stashed:
        """Keep this rank's share of ``x`` (its TP slice when partitioning)."""
        flat = x.detach().reshape(-1)
        n, P = flat.numel(), self._piece_len(flat.numel())
        lo = self.ps.tp_rank * P if self.partition else 0
        src = flat[lo: min(n, lo + P)]
        if self.contiguous:
            if self._slots is None or self._slots.numel() < self.num_slots * P \
                    or self._slots.dtype != flat.dtype:
                self._slots = self._empty(self.num_slots * P, flat.dtype, self._home())
                self.allocations["contiguous"] += 1
            held = self._slots[slot * P: (slot + 1) * P]
        else:
            held = self._empty(P, flat.dtype, self._home())
            self.allocations["tensor"] += 1
        held[: src.numel()].copy_(src, non_blocking=self.cpu)
        held[src.numel():].zero_()  # padding of the last slice
        s = _Stashed(held, x.shape, n, P * flat.element_size())
        self.stored_bytes += s.nbytes
        self.peak = max(self.peak, self.stored_bytes)
        return s

    @torch.no_grad()
    def restore(self, s: _Stashed) -> torch.Tensor:
        """The full input again, on the device; frees the stash's share of the bytes."""
        self.stored_bytes -= s.nbytes
        dev = self.ps.device
        piece = s.held
        if piece.device != dev or self.partition:
            if self._staging is None or self._staging.numel() < piece.numel() \
                    or self._staging.dtype != piece.dtype:
                self._staging = torch.empty(piece.numel(), dtype=piece.dtype, device=dev)
                self.allocations["staging"] += 1
            staged = self._staging[: piece.numel()]
            staged.copy_(piece, non_blocking=True)
            piece = staged
        if not self.partition:
            return piece[: s.numel].view(s.shape)
        tp = self.ps.tp_size
        if self._gather is None or self._gather.numel() < tp * piece.numel() \
                or self._gather.dtype != piece.dtype:
            self._gather = torch.empty(tp * piece.numel(), dtype=piece.dtype, device=dev)
            self.allocations["gather"] += 1
        out = self._gather[: tp * piece.numel()]
        self.ps.tp_group.all_gather(out, piece)
        # A view of the shared gather buffer is safe: this block's recompute and
        # backward finish before the next layer's restore overwrites it.
        return out[: s.numel].view(s.shape)


class _RNGState:
    """CPU, device and TP-tracker RNG states at one moment."""

    def __init__(self, device: torch.device, rng: TPRNGTracker | None):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.dev = get_device_rng_state(device) if device.type == "cuda" else None
        self.tracker = rng.get_states() if rng is not None else None

    def restore(self, rng: TPRNGTracker | None) -> None:
        torch.set_rng_state(self.cpu)
        if self.dev is not None:
            set_device_rng_state(self.dev, self.device)
        if rng is not None and self.tracker is not None:
            rng.set_states(self.tracker)


class _Recompute(torch.autograd.Function):
    """forward: run the block without building a graph, stash its input.
    backward: restore input and RNG, rerun with a graph, backpropagate through it."""

    @staticmethod
    def forward(ctx, run, store: CheckpointStore, slot: int, rng, x):
        ctx.run, ctx.store, ctx.rng = run, store, rng
        ctx.rng_state = _RNGState(x.device, rng)
        with torch.no_grad():
            y = run(x)
        ctx.stashed = store.stash(slot, x)
        return y

    @staticmethod
    def backward(ctx, dy):
        x = ctx.store.restore(ctx.stashed).detach().requires_grad_()
        now = _RNGState(x.device, ctx.rng)
        ctx.rng_state.restore(ctx.rng)
        try:
            with torch.enable_grad():
                y = ctx.run(x)
        finally:
            now.restore(ctx.rng)
        torch.autograd.backward(y, dy)
        ctx.stashed = None
        return None, None, None, None, x.grad


class ActivationCheckpointing:
    """Handle returned by :func:`apply_activation_checkpointing`: bytes and counters."""

    def __init__(self, store: CheckpointStore, blocks: list[nn.Module]):
        self.store, self.blocks = store, blocks

    def stored_bytes(self) -> int:
        """Checkpoint bytes held now (between a forward and its backward)."""
        return self.store.stored_bytes

    def peak_bytes(self) -> int:
        """Most checkpoint bytes held at once since the last :meth:`reset_peak`."""
        return self.store.peak

    def reset_peak(self) -> None:
        self.store.peak = self.store.stored_bytes

    def buffer_bytes(self) -> int:
        bufs = (self.store._gather, self.store._staging, self.store._slots)
        return sum(b.numel() * b.element_size() for b in bufs if b is not None)

    @property
    def allocations(self) -> dict:
        return dict(self.store.allocations)


def apply_activation_checkpointing(model: nn.Module, ps: ParallelState, rng: TPRNGTracker,
                                   cfg) -> ActivationCheckpointing:
    """Checkpoint ``model.blocks[:cfg.recompute_num_layers]`` (all by default).

    Each block's input ``(B, T, C)`` is stored (partitioned over ``ps.tp_group``
    with ``cfg.partition_activations``) and the block is recomputed in backward.
    """
    n = cfg.recompute_num_layers or len(model.blocks)
    store = CheckpointStore(ps, cfg.partition_activations and ps.tp_size > 1,
                            cfg.cpu_checkpointing, cfg.contiguous_checkpointing, n)
    blocks = list(model.blocks)[:n]
    for slot, block in enumerate(blocks):
        run = block.forward  # the class's forward, bound: no hooks, no recursion

        def checkpointed(x, run=run, slot=slot):
            if not torch.is_grad_enabled():  # evaluation: nothing to store
                return run(x)
            return _Recompute.apply(run, store, slot, rng, x)
        block.forward = checkpointed
    return ActivationCheckpointing(store, blocks)
