"""AdamW steps, and the one place that decides what runs them.

    segs = AdamSegments.from_ranges(n, decay_ranges, device)
    found_inf = adam_step(master, grad, exp_avg, exp_avg_sq, out, segs, lr=..., step=t, ...)

:func:`adam_step` is one step over a flat fp32 master shard: the compiled
kernel where one is built, its torch-op reference otherwise (contract below).
:class:`ShardAdamW` is what the ZeRO optimizer asks for -- "an AdamW step over
these parts" -- and it chooses, once, between that kernel, torch's fused
multi-tensor AdamW and eager ops (its docstring says when each runs).

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

from hybrid.kernels.cpu_ops import cpu_ops


def cpu_adam_ext():
    """The compiled CPU step (in ``hybrid_cpu_ops``, :mod:`hybrid.kernels.cpu_ops`) or None."""
    return cpu_ops()


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
    def from_ranges(cls, n: int, decay_ranges, device) -> AdamSegments:
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


# -- AdamW over a ZeRO shard: which implementation answers is decided here ------------------
# torch's fused multi-tensor AdamW (CPU and CUDA); without it, the eager ops below.
_TORCH_FUSED = hasattr(torch, "_fused_adamw_")


class ShardAdamW:
    """AdamW over one rank's optimizer shard cut into parts (one per ZeRO unit); the
    implementation is chosen once, at construction, and callers never learn which.

        adamw = ShardAdamW(master, exp_avg, exp_avg_sq, decay_ranges, hyper, flat, flat_grad)
        adamw.step(grads, lr, scalars, out=shards, found_inf=flag)

    Layout, fixed at construction:
        master, exp_avg, exp_avg_sq: per part, a contiguous fp32 ``(n_i,)`` tensor,
            updated in place.
        decay_ranges: per part, the ``[(lo, hi)]`` that get weight decay.
        hyper: ``(beta1, beta2, eps, weight_decay)``.
        flat: None, or the flat fp32 ``(sum n_i,)`` buffers ``(master, exp_avg,
            exp_avg_sq)`` whose consecutive slices the parts are.
        flat_grad: None, or the flat gradient (any float dtype, parts in the same
            order, on the shard's device) that every :meth:`step` reads.

    ``path``, the implementation :meth:`step` runs:
        "kernel": the compiled step (:func:`adam_step`: ``csrc/cpu_adam.cpp``,
            ``csrc/cuda/fused_adam.cu``) over the flat buffers, one pass per run of
            adjacent ``out`` tensors; needs ``flat`` and ``flat_grad`` and a kernel
            built for the device (:func:`has_adam_kernel`, which follows
            ``--kernel-choice adam=``). It writes ``out`` in the same pass.
        "torch": torch's fused multi-tensor AdamW over the decayed and the undecayed
            segments of the parts (it reads step, scale and skip from tensors).
        "eager": torch ops on host values, for a torch without the fused kernel
            (a host read of the scalars: a sync on a GPU).
    All compute torch.optim.AdamW's arithmetic and agree to rounding, not to the bit:
    the choice is a function of the layout, the device and the kernel settings only,
    so a configuration always takes the same path.
    """

    def __init__(self, master, exp_avg, exp_avg_sq, decay_ranges, hyper, flat=None,
                 flat_grad: torch.Tensor | None = None):
        self.master, self.exp_avg, self.exp_avg_sq = master, exp_avg, exp_avg_sq
        self.decay_ranges = decay_ranges
        self.beta1, self.beta2, self.eps, self.weight_decay = hyper
        self.flat, self.flat_grad = flat, flat_grad
        self._offsets = [0]  # where each part starts in the flat buffers
        for m in master:
            self._offsets.append(self._offsets[-1] + m.numel())
        self._flat_segs: dict = {}  # (first, last) -> AdamSegments of those parts
        if flat is not None:  # the whole shard's, built now rather than in the first step
            self._segments(0, len(master))
        # per weight decay: the (part, lo, hi) segments torch's fused step takes
        self._torch_segs: list[tuple[float, list[tuple[int, int, int]]]] | None = None
        if flat is not None and flat_grad is not None and has_adam_kernel(flat[0].device):
            self.path = "kernel"
        else:
            self.path = "torch" if _TORCH_FUSED else "eager"

    def _segments(self, first: int, last: int) -> AdamSegments:
        """The decay segments of parts ``[first, last)``, in their flat coordinates."""
        if (first, last) not in self._flat_segs:
            lo, hi = self._offsets[first], self._offsets[last]
            ranges = [(a - lo + self._offsets[i], b - lo + self._offsets[i])
                      for i in range(first, last) for a, b in self.decay_ranges[i]]
            self._flat_segs[(first, last)] = AdamSegments.from_ranges(hi - lo, ranges,
                                                                      self.flat[0].device)
        return self._flat_segs[(first, last)]

    @torch.no_grad()
    def step(self, grads, lr: float, scalars: torch.Tensor, out=None,
             found_inf: torch.Tensor | None = None) -> None:
        """AdamW on every part from ``grads * grad_scale``.

        ``grads``: per part, any float dtype and device (the kernel path reads
        ``flat_grad`` instead). ``scalars``: fp64 ``(3,)`` ``[grad_scale, step,
        skip]`` on the shard's device; ``skip != 0`` changes no state. ``out``:
        None, or per part a contiguous tensor (a unit's parameter shard) that
        receives the part's master rounded to its dtype, skipped step or not.
        ``found_inf``: None, or a one-element fp32 flag set to 1.0 when the path
        meets a non-finite gradient element in its pass (the kernel path does;
        the others leave it).
        """
        if self.path == "kernel":
            flat_grad = self.flat_grad
            assert flat_grad is not None  # the kernel path is taken only with one
            if out is None:
                self.step_parts(flat_grad, lr, scalars, 0, len(self.master), None, found_inf)
                return
            for a, b in _adjacent_runs(out):
                run_out = out[a] if b == a + 1 else _joined(out[a], out[b - 1])
                self.step_parts(flat_grad, lr, scalars, a, b, run_out, found_inf)
            return
        grads = [g.to(device=w.device, dtype=torch.float32) for g, w in zip(grads, self.master)]
        if self.path == "torch":
            self._torch_step(grads, lr, scalars)
        else:
            self._eager_step(grads, lr, scalars)
        if out is not None:
            for o, m in zip(out, self.master):
                o.copy_(m)

    @torch.no_grad()
    def step_parts(self, grad: torch.Tensor, lr: float, scalars: torch.Tensor, first: int,
                   last: int, out: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """:func:`adam_step` (the compiled step where built, else its reference) on the
        flat buffers of parts ``[first, last)`` only: ZeRO-Offload's host worker runs
        the shard unit by unit with one ``scalars`` per step, and calling the step on
        pieces gives the bits of one call over the whole (module docstring).

        ``grad``: the flat gradient of the whole shard or of these parts; ``out``:
        None or a flat tensor over these parts.
        """
        lo, hi = self._offsets[first], self._offsets[last]
        if hi == lo:
            return
        g = grad if grad.numel() == hi - lo else grad[lo:hi]
        master, avg, avg_sq = (t[lo:hi] for t in self.flat)
        adam_step(master, g, avg, avg_sq, out, self._segments(first, last), lr=lr,
                  beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                  weight_decay=self.weight_decay, step=1, scalars=scalars, found_inf=found_inf)

    def _torch_step(self, grads, lr: float, scalars: torch.Tensor) -> None:
        """torch's fused multi-tensor AdamW: one pass over each group's segments. It
        reads the step, the gradient scale and the skip flag from tensors."""
        if self._torch_segs is None:
            decayed, plain = [], []
            for i, (w, ranges) in enumerate(zip(self.master, self.decay_ranges)):
                decayed += [(i, lo, hi) for lo, hi in sorted(ranges)]
                plain += [(i, lo, hi) for lo, hi in complement_ranges(ranges, w.numel())]
            self._torch_segs = [(self.weight_decay, decayed), (0.0, plain)]
        step = scalars[1].float()
        inv = (1.0 / scalars[0]).float()  # the kernel divides gradients by grad_scale
        found_inf = scalars[2].float()  # nonzero: the kernel returns before any write
        for decay, segs in self._torch_segs:
            if not segs:
                continue
            torch._fused_adamw_(
                [self.master[i][lo:hi] for i, lo, hi in segs],
                [grads[i][lo:hi] for i, lo, hi in segs],
                [self.exp_avg[i][lo:hi] for i, lo, hi in segs],
                [self.exp_avg_sq[i][lo:hi] for i, lo, hi in segs], [],
                [step] * len(segs), lr=lr, beta1=self.beta1, beta2=self.beta2,
                weight_decay=decay, eps=self.eps, amsgrad=False, maximize=False,
                grad_scale=inv, found_inf=found_inf)

    def _eager_step(self, grads, lr: float, scalars: torch.Tensor) -> None:
        """Plain ops on host values (a torch without the fused kernel)."""
        grad_scale, step, skipped = scalars.tolist()
        if skipped:
            return
        b1, b2 = self.beta1, self.beta2
        bias1 = 1.0 - b1 ** step
        bias2_sqrt = math.sqrt(1.0 - b2 ** step)
        for i, (w, m, v) in enumerate(zip(self.master, self.exp_avg, self.exp_avg_sq)):
            g = grads[i]
            if self.weight_decay > 0:
                for lo, hi in self.decay_ranges[i]:
                    w[lo:hi].mul_(1.0 - lr * self.weight_decay)
            m.mul_(b1).add_(g, alpha=(1.0 - b1) * grad_scale)
            v.mul_(b2).addcmul_(g, g, value=(1.0 - b2) * grad_scale * grad_scale)
            denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
            w.addcdiv_(m, denom, value=-lr / bias1)


def complement_ranges(ranges, n: int) -> list[tuple[int, int]]:
    """The parts of ``[0, n)`` that the disjoint ``ranges`` leave uncovered."""
    out, pos = [], 0
    for lo, hi in sorted(ranges):
        if lo > pos:
            out.append((pos, lo))
        pos = hi
    if pos < n:
        out.append((pos, n))
    return out


def _adjacent_runs(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``[(a, b)]``: maximal runs of tensors that follow each other in one storage."""
    runs, a = [], 0
    for i in range(1, len(tensors) + 1):
        if i == len(tensors) or not _follows(tensors[i - 1], tensors[i]):
            runs.append((a, i))
            a = i
    return runs


def _follows(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (x.dtype == y.dtype and x.device == y.device
            and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
            and x.data_ptr() + x.numel() * x.element_size() == y.data_ptr())


def _joined(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The flat view from ``first``'s start to ``last``'s end (same storage)."""
    start = first.storage_offset()
    n = last.storage_offset() + last.numel() - start
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), start, (n,), (1,))
