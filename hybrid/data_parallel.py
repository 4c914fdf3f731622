"""Plain data parallelism: average gradients over the DP group in fixed-size buckets.

Called once per iteration, after the last micro-batch's backward (gradient
accumulation happens in ``param.grad`` before it). Gradients are packed into
one reusable flat bucket of at most ``bucket_size`` elements per dtype, so the
temporary communication memory is constant whatever the model size; a
parameter larger than a bucket is all-reduced in place on its own.

This is ZeRO stage 0, the baseline the ZeRO stages are measured against.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.comm import CommGroup


class BucketedGradAllReduce:
    """Average ``param.grad`` over ``dp_group`` for every trainable parameter."""

    def __init__(self, params: list[nn.Parameter], dp_group: CommGroup, bucket_size: int):
        self.params = [p for p in params if p.requires_grad]
        self.dp_group = dp_group
        self.bucket_size = bucket_size
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def bucket_bytes(self) -> int:
        """Bytes held by the reusable buckets (the only comm temporaries)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(like.dtype)
        if buf is None:
            same = sum(p.numel() for p in self.params if p.dtype == like.dtype)
            buf = torch.empty(min(self.bucket_size, same), dtype=like.dtype, device=like.device)
            self._buffers[like.dtype] = buf
        return buf

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        if self.dp_group.size == 1:
            return
        for p in self.params:
            if p.grad is None:  # unused this step: every rank must still send its share
                p.grad = torch.zeros_like(p)
        scale = 1.0 / self.dp_group.size
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        # Reverse order: the last layers' grads were ready first (and will be
        # the first to overlap with backward once ZeRO hooks launch buckets early).
        for p in reversed(self.params):
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            buf = self._buffer(grads[0])
            pending, fill = [], 0
            for g in grads:
                if g.numel() > buf.numel():  # too big for a bucket: reduce in place
                    self.dp_group.all_reduce(g)
                    g.mul_(scale)
                    continue
                if fill + g.numel() > buf.numel():
                    self._flush(buf, pending, fill, scale)
                    pending, fill = [], 0
                buf[fill: fill + g.numel()].copy_(g.reshape(-1))
                pending.append((g, fill))
                fill += g.numel()
            self._flush(buf, pending, fill, scale)

    def _flush(self, buf: torch.Tensor, pending, fill: int, scale: float) -> None:
        if not pending:
            return
        chunk = buf[:fill]
        self.dp_group.all_reduce(chunk)
        chunk.mul_(scale)
        for g, off in pending:
            g.copy_(chunk[off: off + g.numel()].view_as(g))
