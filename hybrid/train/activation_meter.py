"""Activation bytes, measured: what autograd actually saves for backward.

    meter = SavedActivationMeter(extra=ac.stored_bytes)
    with meter:                      # one micro-batch's forward and backward
        loss = model(x, y); loss.backward()
    meter.peak                       # the most bytes held for backward at once

Inside the context every tensor autograd saves passes through
``torch.autograd.graph.saved_tensors_hooks``. A storage counts once however
many saved tensors view it, from the first save until autograd frees the last
of them, so ``peak`` is a high-water mark of real memory, not a sum of saves;
recompute's re-run block counts while it exists. Parameters and views of
them (including ZeRO-3's gathered ones) are not activations and are skipped;
``extra`` adds bytes held outside autograd (the activation checkpoints). The
hooks cost a Python call per saved tensor, so training measures one micro-batch
per logged iteration.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SavedActivationMeter:
    """A context measuring the peak bytes saved for backward (see the module doc)."""

    def __init__(self, extra: Callable[[], int] = lambda: 0):
        self.extra = extra
        self.peak = 0
        self._now = 0
        self._live: dict[int, list] = {}  # storage ptr -> [bytes, saved tensors holding it]
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> SavedActivationMeter:
        self.peak, self._now, self._live = 0, 0, {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def held(self) -> int:
        """Bytes held for backward right now (inside the context)."""
        return self._now + self.extra()

    def __exit__(self, *exc) -> None:
        assert self._hooks is not None  # entered
        self._hooks.__exit__(*exc)
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if _is_parameter(t, ptr):
            return t
        entry = self._live.setdefault(ptr, [storage.nbytes(), 0])
        if entry[1] == 0:
            self._now += entry[0]
        entry[1] += 1
        self.peak = max(self.peak, self._now + self.extra())
        return _Held(t, ptr, self, self._live)

    def _release(self, ptr: int, live: dict) -> None:
        if live is not self._live:  # saved under an earlier measurement
            return
        entry = live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self._now -= entry[0]
            del self._live[ptr]


def _is_parameter(t: torch.Tensor, ptr: int) -> bool:
    """A parameter, or a view of one (``weight.t()`` saved by a matmul, the SP view of a
    norm weight): an ``nn.Parameter``, or a tensor whose autograd node leads straight
    to the accumulator of a parameter with the same storage. (Recompute's restored
    block input is a leaf too, but not a parameter: it counts.)"""
    if isinstance(t, torch.nn.Parameter):
        return True
    for node, _ in t.grad_fn.next_functions if t.grad_fn is not None else ():
        leaf = getattr(node, "variable", None)  # AccumulateGrad's tensor
        if isinstance(leaf, torch.nn.Parameter) and leaf.untyped_storage().data_ptr() == ptr:
            return True
    return False


def _unpack(held):
    return held.t if isinstance(held, _Held) else held


class _Held:
    """A saved tensor whose release (autograd dropping it) updates the meter."""

    __slots__ = ("t", "ptr", "meter", "live")

    def __init__(self, t: torch.Tensor, ptr: int, meter: SavedActivationMeter, live: dict):
        self.t, self.ptr, self.meter, self.live = t, ptr, meter, live

    def __del__(self):
        self.meter._release(self.ptr, self.live)
