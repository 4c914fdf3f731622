"""One AdamW step over a flat fp32 master shard, fused where a kernel exists.

    segs = AdamSegments.from_ranges(n, decay_ranges, device)
    found_inf = adam_step(master, grad, exp_avg, exp_avg_sq, out, segs, lr=..., step=t, ...)

Contract (every implementation):
    master, exp_avg, exp_avg_sq: contiguous fp32 ``(n,)``, updated in place.
    grad: contiguous ``(n,)`` fp32/bf16/fp16, read only; the update uses
        ``float(grad) * grad_scale`` (grad_scale folds unscaling and clipping).
    out: None, or contiguous ``(n,)`` fp32/bf16/fp16 that receives the updated
        master rounded to its dtype (the parameter copy to upload).
    segs: which ranges of the shard get weight decay.
    scalars: None, or fp64 ``(3,)`` ``[grad_scale, step, skip]`` on the shard's
        device, overriding ``grad_scale`` and ``step``: the ZeRO engine computes
        its clip coefficient and skip decision as tensors, so no caller reads
        them into Python (a host sync on a GPU). ``skip != 0``: nothing is
        written at all -- master, moments, out and found_inf keep their values.
    found_inf: None, or a one-element fp32 tensor to report into (set to 1.0,
        never cleared), e.g. one flag for several calls over pieces of a shard.
    Returns a one-element fp32 tensor on the shard's device, 1.0 if any
    gradient element was inf/NaN (a report from the same pass, not a guard).

Every element is updated by the same arithmetic whatever the call covers:
the CPU kernel is built with ``-ffp-contract=off`` so that its scalar tail and
its vector body round alike (with contraction the scalar path fuses
multiply-adds the vector path does not, so an element's result depended on
where the thread chunks and the call's bounds fell). Calling it on pieces of
a shard therefore gives the bits of one call over the whole.

Arithmetic is torch.optim.AdamW's: decoupled decay, bias-corrected moments,
eps added after the square root. On CPU the compiled kernel is
``csrc/cpu_adam.cpp`` (ZeRO-Offload's step); on CUDA ``csrc/cuda/fused_adam.cu``;
elsewhere, or with ``--no-kernels`` (``KernelConfig.no_kernels``), the torch-op sequence below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid.kernels.build import load_extension


def cpu_adam_ext():
    """The compiled CPU step (``hybrid_cpu_adam``) or None."""
    # -ffp-contract=off: see "Every element ..." in the module docstring
    return load_extension("hybrid_cpu_adam", ["cpu_adam.cpp"],
                          cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                          ldflags=["-fopenmp"])


def _cuda_ext():
    from hybrid.kernels.cuda_ops import cuda_ops
    return cuda_ops()


def has_adam_kernel(device: torch.device) -> bool:
    """Whether :func:`adam_step` on ``device`` runs a compiled kernel."""
    if device.type == "cpu":
        return cpu_adam_ext() is not None
    from hybrid.kernels.select import kernel_choice
    return kernel_choice("adam", device) == "fused"


@dataclass
class AdamSegments:
    """Segment bounds ``(S+1,)`` int64 and per-segment decay flags ``(S,)`` uint8."""
    bounds: torch.Tensor
    decay: torch.Tensor

    @classmethod
    def from_ranges(cls, n: int, decay_ranges, device) -> "AdamSegments":
        """``decay_ranges``: sorted or not, disjoint ``(lo, hi)`` within ``[0, n)``."""
        bounds, flags, pos = [0], [], 0
        for lo, hi in sorted(r for r in decay_ranges if r[1] > r[0]):
            if lo > pos:
                bounds.append(lo)
                flags.append(0)
            bounds.append(hi)
            flags.append(1)
            pos = hi
        if pos < n or not flags:
            bounds.append(n)
            flags.append(0)
        return cls(torch.tensor(bounds, dtype=torch.int64, device=device),
                   torch.tensor(flags, dtype=torch.uint8, device=device))

    def ranges(self):
        b = self.bounds.tolist()
        return [(b[i], b[i + 1], bool(d)) for i, d in enumerate(self.decay.tolist())]


def adam_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, out: torch.Tensor | None, segs: AdamSegments, *,
              lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              step: int, grad_scale: float = 1.0, use_kernel: bool = True,
              scalars: torch.Tensor | None = None,
              found_inf: torch.Tensor | None = None) -> torch.Tensor:
    """AdamW on the whole shard; see the module docstring for the contract."""
    if found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=master.device)
    ext = None
    if use_kernel:
        ext = cpu_adam_ext() if master.device.type == "cpu" else _cuda_ext()
    args = (lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    if ext is not None:
        ext.adam_step(master, grad, exp_avg, exp_avg_sq, out, segs.bounds, segs.decay,
                      *args, found_inf, scalars)
    else:
        adam_step_reference(master, grad, exp_avg, exp_avg_sq, out, segs, *args, found_inf,
                            scalars)
    return found_inf


@torch.no_grad()
def adam_step_reference(master, grad, exp_avg, exp_avg_sq, out, segs: AdamSegments, lr, beta1,
                        beta2, eps, weight_decay, step, grad_scale, found_inf,
                        scalars: torch.Tensor | None = None) -> None:
    """The same step as torch ops: upcast, scale, decay, moments, update, downcast."""
    if scalars is not None:
        # A host read. The engine reaches this fallback only with host shards
        # (ZeRO-Offload without the compiled kernel): on a GPU without the kernel
        # it runs torch's fused AdamW instead, which takes these as tensors.
        grad_scale, step, skip = scalars.tolist()
        if skip:
            return
        step = int(step)
    torch.maximum(found_inf, (~torch.isfinite(grad)).any().float(), out=found_inf)
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0.0:
        for lo, hi, decay in segs.ranges():
            if decay:
                master[lo:hi].mul_(1.0 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1 ** step))
    if out is not None:
        out.copy_(master)
