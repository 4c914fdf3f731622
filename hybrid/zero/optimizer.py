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
"""

from __future__ import annotations

import math

import torch

from hybrid.comm import CommGroup
from hybrid.kernels.adam import AdamSegments, adam_step

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
        flat_master: the flat buffer ``master`` are views of, in order, if any;
            it enables :meth:`step_flat`.
    """

    def __init__(self, master: list[torch.Tensor], decay_ranges, split_ranges, betas,
                 eps: float, weight_decay: float, flat_master: torch.Tensor | None = None):
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
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.step_count = 0
        self._segs = None
        self._replicated = [_complement(r, w.numel()) for w, r in zip(master, split_ranges)]
        self._flat_segs = None
        if flat_master is not None:
            ranges, off = [], 0
            for w, part in zip(master, decay_ranges):
                ranges += [(off + lo, off + hi) for lo, hi in part]
                off += w.numel()
            self._flat_segs = AdamSegments.from_ranges(off, ranges, flat_master.device)

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
    def step(self, grads: list[torch.Tensor], lr: float, grad_scale: float = 1.0) -> None:
        """AdamW on every part from ``grads * grad_scale`` (unscale and clip folded in)."""
        self.step_count += 1
        grads = [g.to(device=w.device, dtype=torch.float32) for g, w in zip(grads, self.master)]
        if _FUSED:
            self._fused_step(grads, lr, grad_scale)
            return
        b1, b2 = self.beta1, self.beta2
        bias1 = 1.0 - b1 ** self.step_count
        bias2_sqrt = math.sqrt(1.0 - b2 ** self.step_count)
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
    def step_flat(self, grad: torch.Tensor, lr: float, grad_scale: float = 1.0,
                  out: torch.Tensor | None = None, use_kernel: bool = True) -> torch.Tensor:
        """AdamW on the whole flat master in one pass (``hybrid.kernels.adam_step``).

        ``grad``: flat ``(n,)`` gradient of the shard in any float dtype, on the
        master's device, parts in ``master`` order. ``out``: optional flat
        ``(n,)`` buffer that receives the updated parameters in its dtype.
        Returns the kernel's one-element inf/NaN flag.
        """
        self.step_count += 1
        return adam_step(self.flat_master, grad, self._flat_avg, self._flat_avg_sq, out,
                         self._flat_segs, lr=lr, beta1=self.beta1, beta2=self.beta2,
                         eps=self.eps, weight_decay=self.weight_decay, step=self.step_count,
                         grad_scale=grad_scale, use_kernel=use_kernel)

    def _fused_step(self, grads, lr: float, grad_scale: float) -> None:
        """torch's fused multi-tensor AdamW kernel: one pass over each group's ranges."""
        if self._segs is None:
            self._segs = self._segments()
        dev = self.master[0].device
        step = torch.tensor(float(self.step_count), device=dev)
        # the kernel divides gradients by grad_scale
        inv = None if grad_scale == 1.0 else torch.tensor(1.0 / grad_scale, device=dev)
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
                grad_scale=inv, found_inf=None)

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


def _split_like(flat: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for p in parts:
        out.append(flat[off: off + p.numel()])
        off += p.numel()
    return out


@torch.no_grad()
def global_grad_norm(opt: ShardedAdamW, grads: list[torch.Tensor], tp: CommGroup,
                     dp: CommGroup | None) -> float:
    """L2 norm of the whole model's gradient from this rank's parts of it.

    Parts are disjoint across ``dp`` (pass None when every DP rank holds the
    full gradient, stage 0). Across TP, split parameters are summed and
    replicated ones counted once (see the note at the top).
    """
    both = opt.squared_norms(grads)
    if dp is not None:
        dp.all_reduce(both)
    tp.all_reduce(both[:1])
    return math.sqrt(float(both.sum()))
