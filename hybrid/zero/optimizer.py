"""AdamW over this rank's flat shard of the model, with fp32 master weights.

The shard is the concatenation of this rank's part of every unit (all of
every unit at stage 0). Master weights, both Adam moments and the fp32
gradient the step reads are flat ``(n,)`` tensors over it, so the update is a
handful of vectorized ops whatever the number of parameters. Per-parameter
facts the update needs -- whether weight decay applies, whether the parameter
is TP-split (for the norm) -- are kept as ranges of the flat shard.

[Note: counting TP-replicated parameters once]
Across DP the shards are disjoint, so their squared norms add. Inside one DP
replica the TP ranks hold two kinds of parameters: TP shards (disjoint pieces
of a weight, ``param.tp_spec``) and replicated parameters (LayerNorm, position
embeddings, row-parallel biases) whose gradients are identical on every TP
rank. The global squared norm sums the shards' squares over TP and adds the
replicated squares *once*; summing everything over TP would count each
replicated parameter TP times.

The arithmetic is torch.optim.AdamW's (decoupled decay, bias-corrected
moments, eps added after the square root), so a ZeRO run and a plain
single-process run agree to rounding.

[Note: a step without host reads]
The clip coefficient and the skip decision come from the global gradient
norm, a device tensor; reading it into Python would stop the host until the
device has finished backward. So every step method takes ``grad_scale`` (and
``skip``) as tensors, and the step count lives on the shard's device too: a
skipped step does not count, which only the device knows. torch's fused
AdamW reads its step, gradient scale and found-inf flag from tensors; the
compiled kernels take ``[grad_scale, step, skip]`` as one fp64 tensor.
"""

from __future__ import annotations

import math

import torch

from hybrid.config.sections import AdamWConfig
from hybrid.kernels.adam import AdamSegments, adam_step
from hybrid.parallel.comm import CommGroup

# torch's fused AdamW kernel (CPU and CUDA); the plain loop below is the fallback.
_FUSED = hasattr(torch, "_fused_adamw_")


class ShardedAdamW:
    """Adam moments and master weights for this rank's parts of the model.

    Args:
        master: fp32 master weights, one tensor per unit part (views of one
            flat buffer, or the fp32 parameter shards themselves when the model
            is fp32 and not offloaded). Updated in place.
        decay_ranges: per part, ``[(lo, hi)]`` that get weight decay.
        split_ranges: per part, ``[(lo, hi)]`` belonging to TP-split parameters.
        cfg: betas, eps and weight decay (clipping is the caller's: it passes
            the clip coefficient in ``grad_scale``).
        flat_master: the flat buffer ``master`` are views of, in order, if any;
            it enables :meth:`step_flat`.
    """

    def __init__(self, master: list[torch.Tensor], decay_ranges, split_ranges, cfg: AdamWConfig,
                 flat_master: torch.Tensor | None = None):
        self.master = master
        self.flat_master = flat_master
        n = sum(m.numel() for m in master)
        dev = master[0].device if master else torch.device("cpu")
        # Both moments are single flat buffers; parts are views.
        self._flat_avg = torch.zeros(n, dtype=torch.float32, device=dev)
        self._flat_avg_sq = torch.zeros(n, dtype=torch.float32, device=dev)
        self.exp_avg = _split_like(self._flat_avg, master)
        self.exp_avg_sq = _split_like(self._flat_avg_sq, master)
        self.decay_ranges = decay_ranges
        self.split_ranges = split_ranges
        self.beta1, self.beta2 = cfg.beta1, cfg.beta2
        self.eps = cfg.eps
        self.weight_decay = cfg.weight_decay
        # steps applied so far, where the shard lives: see [Note: a step without host reads]
        self._step = torch.zeros((), dtype=torch.float64, device=dev)
        self._segs = None
        self._piece_segs: dict = {}
        self._offsets = [0]  # where each part starts in the flat shard
        for m in master:
            self._offsets.append(self._offsets[-1] + m.numel())
        self._replicated = [_complement(r, w.numel()) for w, r in zip(master, split_ranges)]
        self._flat_segs = None
        if flat_master is not None:
            ranges, off = [], 0
            for w, part in zip(master, decay_ranges):
                ranges += [(off + lo, off + hi) for lo, hi in part]
                off += w.numel()
            self._flat_segs = AdamSegments.from_ranges(off, ranges, flat_master.device)

    @property
    def step_count(self) -> int:
        """Steps applied so far (a host read: for checkpoints and tests)."""
        return int(self._step.item())

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._step.fill_(float(value))

    def begin_step(self, grad_scale, skip: torch.Tensor | None = None) -> torch.Tensor:
        """Count a step (unless ``skip``) and return fp64 ``[grad_scale, step, skip]``
        on the shard's device, the ``scalars`` of :func:`hybrid.kernels.adam.adam_step`.

        ``grad_scale``: a float or a one-element tensor (on the shard's device);
        ``skip``: None or a one-element bool/float tensor there.
        """
        dev = self._step.device
        if isinstance(grad_scale, torch.Tensor):
            scale = grad_scale.reshape(()).to(device=dev, dtype=torch.float64)
        else:  # a fill, not a copy from host memory: no sync on a GPU
            scale = torch.full((), float(grad_scale), dtype=torch.float64, device=dev)
        if skip is None:
            self._step.add_(1.0)
            skip_f = torch.zeros((), dtype=torch.float64, device=dev)
        else:
            skip_f = skip.reshape(()).to(device=dev, dtype=torch.float64)
            self._step.add_(1.0 - skip_f)
        return torch.stack([scale, self._step, skip_f])

    def state_bytes(self) -> int:
        return 2 * self._flat_avg.numel() * self._flat_avg.element_size()

    @torch.no_grad()
    def squared_norms(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """fp64 ``[sum of squares over TP-split ranges, over the replicated ranges]``.

        Each range is reduced in fp32 by one norm kernel (no copy of the
        gradient), partial sums are added in fp64. The replicated sum is taken
        over the replicated ranges themselves -- never as total minus split --
        so it depends only on gradients every TP rank holds bit-identically:
        all TP ranks then reach the same norm to the last bit, hence the same
        clip coefficient, and their copies of replicated parameters never drift.
        """
        out = torch.zeros(2, dtype=torch.float64, device=grads[0].device)
        for g, split, rest in zip(grads, self.split_ranges, self._replicated):
            for k, ranges in enumerate((split, rest)):
                for lo, hi in ranges:
                    out[k] += torch.linalg.vector_norm(g[lo:hi], dtype=torch.float32).double() ** 2
        return out

    def _segments(self):
        """(weight decay, [(part, lo, hi)]) for the decayed and the undecayed ranges."""
        decayed, plain = [], []
        for i, (w, ranges) in enumerate(zip(self.master, self.decay_ranges)):
            decayed += [(i, lo, hi) for lo, hi in sorted(ranges)]
            plain += [(i, lo, hi) for lo, hi in _complement(ranges, w.numel())]
        return [(self.weight_decay, decayed), (0.0, plain)]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float, grad_scale=1.0,
             skip: torch.Tensor | None = None) -> None:
        """AdamW on every part from ``grads * grad_scale`` (unscale and clip folded in);
        nothing changes where ``skip`` (a device flag) is set."""
        sc = self.begin_step(grad_scale, skip)
        grads = [g.to(device=w.device, dtype=torch.float32) for g, w in zip(grads, self.master)]
        if _FUSED:
            self._fused_step(grads, lr, sc)
            return
        # torch without the fused kernel: plain ops on host values (a sync on a GPU)
        grad_scale, step, skipped = sc.tolist()
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

    @torch.no_grad()
    def step_flat(self, grad: torch.Tensor, lr: float, grad_scale=1.0,
                  skip: torch.Tensor | None = None, out=None,
                  use_kernel: bool = True) -> torch.Tensor:
        """AdamW on the whole flat master in one pass (``hybrid.kernels.adam_step``).

        ``grad``: flat ``(n,)`` gradient of the shard in any float dtype, on the
        master's device, parts in ``master`` order. ``out``: None; a flat
        ``(n,)`` buffer that receives the updated parameters in its dtype; or
        one contiguous tensor per part (each unit's parameter shard: the
        kernel's copy-out then *is* the publication of the new parameters).
        Parts whose ``out`` tensors follow each other in memory share one call.
        Returns the kernel's one-element inf/NaN flag.
        """
        sc = self.begin_step(grad_scale, skip)
        found = torch.zeros(1, dtype=torch.float32, device=self.flat_master.device)
        if out is None or isinstance(out, torch.Tensor):
            self._run(grad, lr, sc, 0, len(self.master), out, found, use_kernel)
            return found
        for a, b in _adjacent_runs(out):
            run_out = out[a] if b == a + 1 else _joined(out[a], out[b - 1])
            self._run(grad, lr, sc, a, b, run_out, found, use_kernel)
        return found

    def step_parts(self, grad: torch.Tensor, lr: float, scalars: torch.Tensor, first: int,
                   last: int, out: torch.Tensor | None, found: torch.Tensor,
                   use_kernel: bool = True) -> None:
        """AdamW on parts ``[first, last)`` only, with ``scalars`` from :meth:`begin_step`
        (one per step, whatever the number of pieces it is applied in)."""
        self._run(grad, lr, scalars, first, last, out, found, use_kernel)

    def _run(self, grad, lr, scalars, first, last, out, found, use_kernel) -> None:
        lo, hi = self._offsets[first], self._offsets[last]
        if hi == lo:
            return
        whole = (first, last) == (0, len(self.master))
        if not whole and (first, last) not in self._piece_segs:
            ranges, off = [], 0
            for w, part in zip(self.master[first:last], self.decay_ranges[first:last]):
                ranges += [(off + a, off + b) for a, b in part]
                off += w.numel()
            self._piece_segs[(first, last)] = AdamSegments.from_ranges(
                off, ranges, self.flat_master.device)
        segs = self._flat_segs if whole else self._piece_segs[(first, last)]
        g = grad if grad.numel() == hi - lo else grad[lo:hi]
        adam_step(self.flat_master[lo:hi], g, self._flat_avg[lo:hi], self._flat_avg_sq[lo:hi],
                  out, segs, lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                  weight_decay=self.weight_decay, step=1, use_kernel=use_kernel,
                  scalars=scalars, found_inf=found)

    def _fused_step(self, grads, lr: float, scalars: torch.Tensor) -> None:
        """torch's fused multi-tensor AdamW kernel: one pass over each group's ranges.
        It reads the step, the gradient scale and the skip flag from tensors."""
        if self._segs is None:
            self._segs = self._segments()
        step = scalars[1].float()
        inv = (1.0 / scalars[0]).float()  # the kernel divides gradients by grad_scale
        found_inf = scalars[2].float()  # nonzero: the kernel returns before any write
        for decay, segs in self._segs:
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

    def state_dict(self) -> dict:
        return {"step": self.step_count, "exp_avg": self._flat_avg, "exp_avg_sq": self._flat_avg_sq}


def _complement(ranges, n: int) -> list[tuple[int, int]]:
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
        first.untyped_storage(), start, (n,))


def _split_like(flat: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for p in parts:
        out.append(flat[off: off + p.numel()])
        off += p.numel()
    return out


@torch.no_grad()
def global_grad_norm(opt: ShardedAdamW, grads: list[torch.Tensor], tp: CommGroup,
                     dp: CommGroup | None) -> torch.Tensor:
    """L2 norm of the whole model's gradient from this rank's parts of it, as a
    0-dim fp64 tensor on the gradients' device (never read here).

    Parts are disjoint across ``dp`` (pass None when every DP rank holds the
    full gradient, stage 0). Across TP, split parameters are summed and
    replicated ones counted once (see the note at the top).
    """
    both = opt.squared_norms(grads)
    if dp is not None:
        dp.all_reduce(both)
    tp.all_reduce(both[:1])
    return both.sum().sqrt()
