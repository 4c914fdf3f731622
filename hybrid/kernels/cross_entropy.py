"""Per-rank pieces of the vocab-parallel cross-entropy, kernel or PyTorch.

Shapes: ``logits (N, V)`` this rank's vocabulary slice (fp32/bf16/fp16) holding
global ids ``[vocab_start, vocab_start + V)``; ``target (N,)`` int64 global ids.
Columns ``>= valid`` are padded vocabulary: treated as -inf whatever they hold
(the fallback also accepts padding already masked to -inf, as GPT.forward does
when it returns logits).

    m, s, t = local_softmax_stats(logits, target, vocab_start, valid)
        fp32 (N,) each: local max (-inf if no valid column), sum of
        exp(x - m) over valid columns, target logit (0 if the target id is
        not on this rank).
    grad = softmax_grad(logits, target, vocab_start, valid, M, S, grad_loss)
        (N, V) in the logits dtype: (exp(x - M) / S - onehot(target)) * grad_loss
        with the global max M and sum S = sum exp(x - M) (fp32 (N,) each); 0 on
        padding. The (N, V) softmax is never kept between forward and backward.
"""

from __future__ import annotations

import torch

from hybrid.kernels.select import compiled, kernel_choice

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_kernel(logits: torch.Tensor) -> bool:
    return (kernel_choice("cross_entropy", logits.device) == "fused" and logits.dim() == 2
            and logits.dtype in _DTYPES)


def _local_target(target, vocab_start: int, width: int):
    t = target - vocab_start
    inside = (t >= 0) & (t < width)
    return t.masked_fill(~inside, 0), inside


def stats_eager(logits, target, vocab_start: int, valid: int):
    x = logits[:, :valid].float()
    if valid > 0:
        m = x.amax(dim=-1)  # (no indices: a tenth of max(dim)'s time on CPU)
    else:
        m = torch.full(logits.shape[:1], float("-inf"), device=logits.device)
    # A row with no finite logit has m = -inf; shift by 0 there so exp gives 0, not NaN.
    shift = m.masked_fill(m == float("-inf"), 0.0)
    s = (x - shift.unsqueeze(-1)).exp_().sum(dim=-1)
    if logits.shape[-1] == 0:  # a slice cut down to nothing (all padding)
        return m, s, torch.zeros_like(s)
    t, inside = _local_target(target, vocab_start, logits.shape[-1])
    tl = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1).float().masked_fill(~inside, 0.0)
    return m, s, tl


def grad_eager(logits, target, vocab_start: int, valid: int, M, S, grad_loss):
    if valid == 0:  # a rank holding only padding
        return torch.zeros_like(logits)
    p = (logits[:, :valid].float() - M.unsqueeze(-1)).exp_().div_(S.unsqueeze(-1))
    t, inside = _local_target(target, vocab_start, valid)
    p.scatter_add_(-1, t.unsqueeze(-1), -inside.unsqueeze(-1).to(p.dtype))
    p.mul_(grad_loss.unsqueeze(-1))
    if valid == logits.shape[-1]:
        return p.to(logits.dtype)
    out = torch.zeros_like(logits)
    out[:, :valid] = p
    return out


def local_softmax_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                        valid: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local max, local sum-exp, target logit), fp32 (N,) each; see the module doc."""
    valid = logits.shape[-1] if valid is None else max(0, min(int(valid), logits.shape[-1]))
    if _use_kernel(logits) and logits.shape[-1]:
        from hybrid.kernels.cuda_ops import cuda_ops
        m, s, t = cuda_ops().ce_stats(logits.contiguous(), target.contiguous(),
                                      int(vocab_start), valid)
        return m, s, t
    if kernel_choice("cross_entropy", logits.device) == "compile":
        return compiled(stats_eager)(logits, target, vocab_start, valid)
    return stats_eager(logits, target, vocab_start, valid)


def softmax_grad(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                 valid: int | None, M: torch.Tensor, S: torch.Tensor,
                 grad_loss: torch.Tensor) -> torch.Tensor:
    """d loss / d logits ``(N, V)`` in the logits dtype; see the module doc."""
    valid = logits.shape[-1] if valid is None else max(0, min(int(valid), logits.shape[-1]))
    M, S, grad_loss = (t.float().contiguous() for t in (M, S, grad_loss))
    if _use_kernel(logits) and logits.shape[-1]:
        from hybrid.kernels.cuda_ops import cuda_ops
        return cuda_ops().ce_grad(logits.contiguous(), target.contiguous(), M, S, grad_loss,
                                  int(vocab_start), valid)
    if kernel_choice("cross_entropy", logits.device) == "compile":
        return compiled(grad_eager)(logits, target, vocab_start, valid, M, S, grad_loss)
    return grad_eager(logits, target, vocab_start, valid, M, S, grad_loss)
