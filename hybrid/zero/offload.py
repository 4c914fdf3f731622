"""ZeRO-Offload: the optimizer step runs on the host, over host copies of the shard.

The fp32 master shard and both Adam moments live in host memory (allocated by
the engine, pinned when a GPU exists). Each step this module moves

    device gradient shard  --(D2H, gradient dtype)-->  host gradient buffer
    host parameter copy    --(H2D, training dtype)-->  device parameter shard

and the fused CPU kernel (``hybrid.kernels.adam_step``) reads the first and
writes the second in the same pass as the Adam update. Moving the training
dtype both ways (not fp32) is what keeps the PCIe traffic at 2x the shard in
bf16/fp16, the same as the ZeRO-Offload paper's 4 bytes per parameter per step.

On a CPU-only machine the same path runs with host tensors; at stages 2-3 the
engine's flat gradient shard is already a contiguous host buffer in master
order, so it is used as is rather than copied.
"""

from __future__ import annotations

import torch

from hybrid.zero.flat_unit import FlatUnit


class OptimizerOffload:
    """Host staging buffers for one rank's shard.

    Args:
        units: the engine's units; unit ``i`` owns ``[own_lo, own_hi)`` of its flat
            buffer, and the host buffers hold those pieces back to back.
        dtype: the model's training dtype (the parameters that go back up).
        flat_grads: the engine's flat gradient buffer (its dtype is what goes
            down); reused as the host gradient buffer when it already is one
            (CPU, gradients sharded).
        plan: the engine's :class:`~hybrid.zero.plan.ShardingPlan`.
    """

    def __init__(self, units: list[FlatUnit], dtype: torch.dtype, flat_grads: torch.Tensor,
                 plan):
        self.sizes = [u.own_hi - u.own_lo for u in units]
        n = sum(self.sizes)
        self.pin = flat_grads.is_cuda  # pinned host memory makes the copies asynchronous DMA
        on_host_in_order = flat_grads.device.type == "cpu" and plan.grads
        self.grad = flat_grads if on_host_in_order else torch.empty(
            n, dtype=flat_grads.dtype, pin_memory=self.pin)
        self._own_grad = not on_host_in_order
        # fp32 models upload the master itself: no narrow copy to make.
        self.out = None if dtype == torch.float32 else torch.empty(
            n, dtype=dtype, pin_memory=self.pin)

    def _pieces(self, flat: torch.Tensor):
        off = 0
        for n in self.sizes:
            yield flat[off: off + n]
            off += n

    @torch.no_grad()
    def grads_to_host(self, units: list[FlatUnit]) -> torch.Tensor:
        """The shard's gradient as one flat host tensor (training dtype)."""
        if self._own_grad:
            for u, dst in zip(units, self._pieces(self.grad)):
                dst.copy_(u.grad_shard, non_blocking=self.pin)
            if self.pin:  # the kernel reads the buffer from the CPU next
                torch.cuda.current_stream().synchronize()
        return self.grad

    @torch.no_grad()
    def params_to_device(self, units: list[FlatUnit], master: torch.Tensor,
                         after_step: bool) -> None:
        """Updated parameters into each unit's shard.

        ``after_step``: the kernel has just written ``out``; otherwise (e.g. a
        checkpoint was loaded into the master) the master is the source.
        """
        src = self.out if (after_step and self.out is not None) else master
        for u, piece in zip(units, self._pieces(src)):
            u.shard.copy_(piece, non_blocking=self.pin)
        if self.pin:  # `out` is rewritten by the next step while copies may be in flight
            torch.cuda.current_stream().synchronize()

    def nbytes(self) -> int:
        own = self.grad.untyped_storage().nbytes() if self._own_grad else 0
        return own + (0 if self.out is None else self.out.untyped_storage().nbytes())
