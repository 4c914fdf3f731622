"""Split a fused, grouped QKV into query, key and value heads, with rotary embeddings.

    q, k, v = split_qkv(qkv, q_per_group, head_size, rotary)

``qkv`` is ``(B, T, g * (r + 2) * hs)``: per query group (a key/value head),
``r = q_per_group`` query heads, then the key head, then the value head --
Megatron's layout, which keeps whole groups in any contiguous TP chunk (and
with ``r = 1`` is the per-head ``[q k v]`` of GPT-2). Returned: ``q`` ``(B, g r,
T, hs)``, ``k`` and ``v`` ``(B, g, T, hs)``, fresh tensors stored token-major
(transposed views, as views of ``qkv`` would be), query head ``i`` using
key/value head ``i // r`` (Hugging Face's ``repeat_kv``).

``rotary`` (a :class:`Rotary`, or None) rotates the first ``rotary.dim``
channels of every query and key head by position (RoPE, Su et al. 2021) in
the rotate-half convention of Hugging Face's Llama: channel ``j < dim/2`` pairs
with ``j + dim/2`` and turns by ``pos * base^(-2j/dim)``; the other channels
pass through (``--rotary-percent`` below 1). cos and sin are computed in fp32
and cast to the activations' dtype, as Hugging Face does.

One autograd Function that saves nothing: a rotation's transpose is the
rotation by the opposite angle, so backward recomputes cos and sin (``T x
dim/2`` values) and rotates the gradients back. The three outputs are what the
attention kernel then keeps, the same bytes as the fused QKV output itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Llama-3.1's RoPE scaling (Megatron's --use-rope-scaling fixes these three; so do the
# released Llama 3.1, 3.2 and 3.3 configs)
LOW_FREQ_FACTOR, HIGH_FREQ_FACTOR, ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama-3.1's frequency scaling: channels whose wavelength ``2 pi / f`` is shorter
    than ``ORIGINAL_CONTEXT / HIGH_FREQ_FACTOR`` tokens keep their frequency (they
    resolve nearby tokens), those longer than ``ORIGINAL_CONTEXT / LOW_FREQ_FACTOR``
    turn ``factor`` times slower (they span the context), and those between move
    linearly, in ``ORIGINAL_CONTEXT / wavelength``, from one to the other."""
    wavelen = 2 * math.pi / inv_freq
    smooth = ((ORIGINAL_CONTEXT / wavelen - LOW_FREQ_FACTOR)
              / (HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR))
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > ORIGINAL_CONTEXT / LOW_FREQ_FACTOR, inv_freq / factor, between)
    return torch.where(wavelen < ORIGINAL_CONTEXT / HIGH_FREQ_FACTOR, inv_freq, out)


@dataclass(frozen=True)
class Rotary:
    """RoPE on the first ``dim`` channels of a head (even), with frequency base ``base``;
    ``scaling_factor``: Llama-3.1's frequency scaling by that factor (None: off);
    ``interpolation``: positions divided by it (linear position interpolation, Chen
    et al. 2023; None: off)."""

    dim: int
    base: float = 10000.0
    scaling_factor: float | None = None
    interpolation: float | None = None

    def cos_sin(self, positions, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        """(cos, sin), each ``(T, dim)``: ``[f | f]`` with ``f = pos * base^(-2j/dim)``
        (frequencies scaled by :func:`llama3_scaled` when ``scaling_factor`` is set).
        ``positions``: T (positions 0..T-1), or a ``(T,)`` tensor of the tokens' global
        positions (a context-parallel rank's, :func:`hybrid.tensor_parallel.cp_positions`)."""
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float,
                                                     device=device) / self.dim))
        if self.scaling_factor is not None:
            inv_freq = llama3_scaled(inv_freq, self.scaling_factor)
        pos = (torch.arange(positions, device=device) if isinstance(positions, int)
               else positions.to(device)).float()
        if self.interpolation is not None:
            pos = pos / self.interpolation
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, T, heads, hs)`` with its first ``cos.shape[-1]`` channels rotated;
    ``cos`` and ``sin`` are ``(T, 1, dim)``."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    r = x[..., :d]
    return torch.cat((r * cos + _rotate_half(r) * sin, x[..., d:]), dim=-1)


class SplitQKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, q_per_group: int, head_size: int, rotary: Rotary | None,
                positions: torch.Tensor | None = None):
        B, T, _ = qkv.shape
        r = q_per_group
        x = qkv.view(B, T, -1, r + 2, head_size)  # (B, T, g, r + 2, hs)
        g = x.shape[2]
        # Token-major storage (B, T, heads, hs), returned as (B, heads, T, hs) views: the
        # attention output then comes back token-major too, and merging its heads for
        # the projection is a view, not a copy.
        q = x[:, :, :, :r].reshape(B, T, g * r, head_size)
        k, v = x[:, :, :, r].contiguous(), x[:, :, :, r + 1].contiguous()
        ctx.meta = (B, T, g, r, head_size, rotary, positions)
        if rotary is not None:
            where = T if positions is None else positions
            cos, sin = (t[:, None] for t in rotary.cos_sin(where, qkv.dtype, qkv.device))
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        B, T, g, r, hs, rotary, positions = ctx.meta
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)  # (B, T, h, hs)
        if rotary is not None:  # rotate back: the transpose of R(theta) is R(-theta)
            where = T if positions is None else positions
            cos, sin = (t[:, None] for t in rotary.cos_sin(where, dq.dtype, dq.device))
            dq, dk = _rotate(dq, cos, -sin), _rotate(dk, cos, -sin)
        grad = torch.empty(B, T, g, r + 2, hs, dtype=dq.dtype, device=dq.device)
        grad[:, :, :, :r] = dq.reshape(B, T, g, r, hs)
        grad[:, :, :, r] = dk
        grad[:, :, :, r + 1] = dv
        return grad.view(B, T, g * (r + 2) * hs), None, None, None, None


def split_qkv(qkv: torch.Tensor, q_per_group: int, head_size: int,
              rotary: Rotary | None = None, positions: torch.Tensor | None = None):
    """``(q, k, v)`` heads of a grouped QKV, RoPE applied to q and k (see the module doc);
    ``positions``: the tokens' global positions when they are not 0..T-1 (context
    parallelism)."""
    return SplitQKVFunction.apply(qkv, q_per_group, head_size, rotary, positions)
