"""Vocab-parallel cross-entropy equals F.cross_entropy, without ever gathering logits."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.tensor_parallel import vocab_parallel_cross_entropy
from tests.helpers.harness import run_ranks

V, PAD = 32, 8  # the last PAD columns play the padded vocabulary (masked to -inf)


def _logits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, V, generator=g) * 50  # large logits: the max-shift must work
    x[..., V - PAD:] = float("-inf")
    # targets in every TP partition (never in the padding)
    t = torch.arange(15).view(3, 5) * 7 % (V - PAD)
    return x, t


def _ce_worker(ps, cut=False):
    x, t = _logits()
    local = x.chunk(ps.tp_size, -1)[ps.tp_rank]
    start = ps.tp_rank * local.shape[-1]
    if cut:  # the model's way: padding cut off, slices of unequal (even zero) width
        local = local[..., : max(0, min(local.shape[-1], V - PAD - start))]
    local = local.clone().requires_grad_()
    ps.comm_stats.reset()
    loss = vocab_parallel_cross_entropy(local, t, ps.tp_group, start=start)
    calls = dict(ps.comm_stats.calls)
    loss.backward(torch.linspace(0.5, 1.5, 15).view(3, 5))
    return loss.detach(), local.grad, calls, _scratch_is_bit_equal(ps, local, t, start, loss)


def _scratch_is_bit_equal(ps, local, t, start, loss):
    """The model's way (``scratch=True``: logits nobody reads again, a GEMM's output)
    gives the same bits, and did overwrite the logits (when there are any)."""
    leaf = local.detach().clone().requires_grad_()
    logits = leaf * 1.0  # a non-leaf, as the head's output is
    before = logits.detach().clone()
    out = vocab_parallel_cross_entropy(logits, t, ps.tp_group, start=start, scratch=True)
    out.backward(torch.linspace(0.5, 1.5, 15).view(3, 5))
    overwritten = logits.numel() == 0 or not torch.equal(logits.detach(), before)
    return (torch.equal(out.detach(), loss.detach()) and torch.equal(leaf.grad, local.grad)
            and overwritten)


@pytest.mark.parametrize("tp,cut", [(2, False), (4, False), (4, True)])
def test_matches_torch_cross_entropy_and_never_gathers(tp, cut):
    res = run_ranks(_ce_worker, world_size=tp, tp=tp, args=(cut,))
    x, t = _logits()
    real = x[..., : V - PAD].clone().requires_grad_()
    ref = F.cross_entropy(real.flatten(0, 1), t.flatten(), reduction="none").view(3, 5)
    ref.backward(torch.linspace(0.5, 1.5, 15).view(3, 5))
    grad = torch.cat([r[1] for r in res], -1)
    for loss, _, calls, scratch_ok in res:
        assert scratch_ok
        assert torch.isfinite(loss).all()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
        # the max, then the sum of exponentials and the target logit in one
        assert calls["all_gather"] == 0 and calls["all_reduce"] == 2
    if cut:  # TP 4 over 32 columns, 8 of them padding: the last rank holds none
        assert [r[1].shape[-1] for r in res] == [8, 8, 8, 0]
    torch.testing.assert_close(grad[..., : V - PAD], real.grad, rtol=1e-5, atol=1e-6)
    assert (grad[..., V - PAD:] == 0).all()
