"""Cross-entropy over logits split by vocabulary across TP ranks.

Each rank holds ``logits[..., V/tp]`` for its vocabulary slice. The loss needs
three numbers per token that span the whole vocabulary: the max (for a stable
softmax), the sum of exponentials, and the target's logit. Each is a small
all-reduce over TP of a ``(...)`` tensor, so the full ``(..., V)`` logits are
never built on any rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.comm import CommGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group: CommGroup):
        # fp32 for the softmax whatever the model dtype: bf16 exp-sums lose the loss.
        x = logits.float()
        local_v = x.shape[-1]
        start = group.rank * local_v

        m = x.max(dim=-1).values
        group.all_reduce(m, op=dist.ReduceOp.MAX)
        x = x - m.unsqueeze(-1)

        inside = (target >= start) & (target < start + local_v)
        local_t = (target - start).masked_fill(~inside, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        group.all_reduce(target_logit)

        exp = x.exp_()  # x is our own fp32 copy, safe to overwrite
        sum_exp = exp.sum(dim=-1)
        group.all_reduce(sum_exp)

        loss = sum_exp.log() - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # now this rank's slice of the softmax
        ctx.save_for_backward(exp, local_t, inside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, inside = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(target), onehot only on the owning rank
        grad = softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -inside.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: CommGroup) -> torch.Tensor:
    """Per-token loss ``(...)`` from ``logits (..., V/tp)`` split over ``group``.

    ``target`` holds global vocabulary ids ``(...)``. Collectives: three
    all-reduces over the TP group of ``(...)``-shaped tensors.
    """
    if group.size == 1:
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, -2), target.flatten(), reduction="none"
        ).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group)
