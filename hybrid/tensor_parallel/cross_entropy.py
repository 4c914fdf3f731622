"""Cross-entropy over logits split by vocabulary across TP ranks.

Each rank holds ``logits[..., V/tp]`` for its vocabulary slice. The loss needs
three numbers per token that span the whole vocabulary: the max (for a stable
softmax), the sum of exponentials, and the target's logit. They take two small
all-reduces over TP of ``(...)`` tensors -- the max first, then the sum (shifted
by that max) and the target logit in one -- so the full ``(..., V)`` logits are
never built on any rank. The per-rank work (local statistics, and the gradient
recomputed from the saved logits in backward) is in
:mod:`hybrid.kernels.cross_entropy`, fused on GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.kernels.cross_entropy import local_softmax_stats, softmax_grad
from hybrid.kernels.select import kernel_choice
from hybrid.parallel.comm import CommGroup


def _global_stats(m, s, target_logit, group: CommGroup):
    """(global max M, sum of exp(x - M), target logit), all ``(N,)`` fp32, from this
    rank's local max ``m``, its sum of ``exp(x - m)`` ``s`` and its target logit (0
    where another rank owns the target): two all-reduces over ``group``, the max,
    then the rescaled sum and the target logit together."""
    M = m.clone()
    group.all_reduce(M, op=dist.ReduceOp.MAX)
    # Rescale this rank's sum to the global max; a rank with no finite logit in a row
    # has m = -inf and s = 0, and exp(-inf - M) = 0 keeps it at 0.
    both = torch.stack((s * (m - M).exp_(), target_logit))
    group.all_reduce(both)
    return M, both[0], both[1]


# [Note: the softmax in the logits' storage]
# The eager path needs an fp32 (..., V/tp) buffer for x - max, exp and the softmax it
# keeps for backward. With fp32 logits that only the loss reads (the model's own head:
# its GEMM's backward needs the head's input and weight, not its output) that buffer
# can be the logits themselves, as Megatron's loss does: one large allocation fewer per
# call (in a CPU profile at TP 2 the out-of-place shift took twice the exp's time, and
# the loss's share of a step halved without it). The arithmetic is the same ops on the
# same values, so the bits are too. Autograd is told (mark_dirty), which needs the
# overwritten tensor returned: it is a second output that the wrapper drops.


class _FusedVocabParallelCE(torch.autograd.Function):
    """Kernel path: saves the logits, recomputes the softmax in backward."""

    @staticmethod
    def forward(ctx, logits, target, group: CommGroup, start: int, valid: int | None):
        # Per-row statistics in fp32 from one pass over this rank's logits (a fused
        # online-softmax kernel on GPU); the (..., V/tp) softmax is never stored.
        x = logits.flatten(0, -2)  # (N, V / tp); flatten: the width may be 0
        t = target.reshape(-1)
        M, S, target_logit = _global_stats(*local_softmax_stats(x, t, start, valid), group)
        loss = S.log() - (target_logit - M)
        ctx.save_for_backward(x, t, M, S)
        ctx.meta = (start, valid, logits.shape)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x, t, M, S = ctx.saved_tensors
        start, valid, shape = ctx.meta
        # d loss / d logits = softmax - onehot(target), onehot only on the owning rank,
        # recomputed from the saved logits.
        grad = softmax_grad(x, t, start, valid, M, S, grad_loss.reshape(-1))
        return grad.view(shape), None, None, None, None


class _EagerVocabParallelCE(torch.autograd.Function):
    """PyTorch ops: keeps this rank's fp32 softmax slice for backward. With ``scratch``
    (fp32 logits only) the softmax is built in the logits' own storage (see [Note: the
    softmax in the logits' storage]); the overwritten logits are a second output."""

    @staticmethod
    def forward(ctx, logits, target, group: CommGroup, start: int, scratch: bool):
        # fp32 for the softmax whatever the model dtype: bf16 exp-sums lose the loss.
        x = logits.float()
        local_v = x.shape[-1]
        # A fresh tensor, reduced in place (max(dim) also finds indices: 10x slower on CPU);
        # -inf on a rank whose slice is all padding, cut off by the caller.
        M = x.amax(dim=-1) if local_v else torch.full(target.shape, float("-inf"), device=x.device)
        group.all_reduce(M, op=dist.ReduceOp.MAX)
        if x is logits and not scratch:
            x = x - M.unsqueeze(-1)  # our own fp32 copy from here on
        else:  # a copy of ours already, or logits the caller gave up
            x.sub_(M.unsqueeze(-1))
        if scratch:  # (fp32 logits: x is logits)
            ctx.mark_dirty(logits)
            ctx.set_materialize_grads(False)  # (nothing flows back into the second output)

        inside = (target >= start) & (target < start + local_v)
        local_t = (target - start).masked_fill(~inside, 0)
        target_logit = (x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
                        if local_v else torch.zeros_like(M))
        exp = x.exp_()
        both = torch.stack((exp.sum(dim=-1), target_logit))  # one all-reduce for the two
        group.all_reduce(both)
        sum_exp, target_logit = both[0], both[1]

        loss = sum_exp.log() - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # now this rank's slice of the softmax
        ctx.save_for_backward(exp, local_t, inside)
        ctx.logits_dtype = logits.dtype
        return (loss, logits) if scratch else loss

    @staticmethod
    def backward(ctx, grad_loss, _grad_logits=None):
        softmax, local_t, inside = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(target), onehot only on the owning rank
        grad = softmax
        if grad.shape[-1]:
            grad.scatter_add_(-1, local_t.unsqueeze(-1), -inside.unsqueeze(-1).to(grad.dtype))
            grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: CommGroup, valid: int | None = None,
                                 start: int | None = None, scratch: bool = False) -> torch.Tensor:
    """Per-token loss ``(...)`` from ``logits (..., V/tp)`` split over ``group``.

    ``target`` holds global vocabulary ids ``(...)``. ``start``: the global id of
    this rank's first column (default ``rank * width``: equal slices). A caller
    that cut its padding off passes its own ``start`` and slices of different
    widths, even empty ones (:class:`models.gpt.GPT` does). ``valid``: how many
    of this rank's columns are real vocabulary (the rest is padding, ignored
    whatever it holds); None means all. Padding may instead be masked to -inf by
    the caller. Collectives: two all-reduces over the TP group of ``(...)``-shaped
    fp32 tensors (the max; then the sum of exponentials with the target logit).
    ``scratch``: the caller never reads ``logits`` again, so the eager path may
    overwrite them (see [Note: the softmax in the logits' storage]).
    """
    if start is None:
        start = group.rank * logits.shape[-1]
    if kernel_choice("cross_entropy", logits.device) == "eager":
        if valid is not None and valid < logits.shape[-1]:
            pad = torch.arange(logits.shape[-1], device=logits.device) >= valid
            logits = logits.masked_fill(pad, float("-inf"))
        if group.size == 1:  # torch's own cross-entropy is the fast path on one rank
            return torch.nn.functional.cross_entropy(
                logits.float().flatten(0, -2), target.flatten(), reduction="none"
            ).view(target.shape)
        if scratch and logits.dtype == torch.float32:  # (else the fp32 copy is ours anyway)
            return _EagerVocabParallelCE.apply(logits, target, group, start, True)[0]
        return _EagerVocabParallelCE.apply(logits, target, group, start, False)
    return _FusedVocabParallelCE.apply(logits, target, group, start, valid)
