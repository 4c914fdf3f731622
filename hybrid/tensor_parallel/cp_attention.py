"""``ContextParallel``: what a model needs to run on one CP rank's share of each sequence.

Built once from the CP group and the two choices of the parallel section
(``--cp-comm-type``, ``--cp-layout``); the attention path is bound then, not
tested per call. The model asks it for its tokens' global positions (RoPE,
learned position embeddings) and for attention across the split:

* ``p2p``: ring attention (:class:`~hybrid.tensor_parallel.ring_attention.RingAttention`);
* ``all_gather``: K/V gathered once per layer (:class:`~...GatheredAttention`);
* ``a2a``: Ulysses (:mod:`hybrid.tensor_parallel.ulysses_attention`), heads split instead.

Which layout, which comm: see the notes of :mod:`hybrid.tensor_parallel.context_parallel`
and :mod:`hybrid.tensor_parallel.ring_attention`.
"""

from __future__ import annotations

import torch

from hybrid.config.sections import CP_COMM_TYPES, CP_LAYOUTS
from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.context_parallel import segments
from hybrid.tensor_parallel.mappings import sum_over_group
from hybrid.tensor_parallel.ring_attention import (
    GatheredAttention,
    LocalAttention,
    RingAttention,
    Spec,
    draw_dropout_seed,
)
from hybrid.tensor_parallel.ulysses_attention import sdpa_causal, ulysses_attention


class ContextParallel:
    """The CP group of this rank and how attention crosses it."""

    def __init__(self, group: CommGroup, comm_type: str = "p2p", layout: str = "load_balanced"):
        if comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type must be one of {CP_COMM_TYPES}, got {comm_type!r}")
        if layout not in CP_LAYOUTS:
            raise ValueError(f"--cp-layout must be one of {CP_LAYOUTS}, got {layout!r}")
        self.group, self.comm_type, self.layout = group, comm_type, layout
        self.size, self.rank = group.size, group.rank
        self._attend = {"p2p": self._exchange, "all_gather": self._exchange,
                        "a2a": self._all_to_all}[comm_type]
        self._exchange_fn = RingAttention if comm_type == "p2p" else GatheredAttention

    def __repr__(self) -> str:
        return f"ContextParallel(size={self.size}, {self.comm_type}, {self.layout})"

    def check_heads(self, heads: int, groups: int) -> None:
        """ValueError unless this rank's ``heads`` query and ``groups`` K/V heads can
        be split over the CP group (the a2a exchange only)."""
        if self.comm_type == "a2a" and (heads % self.size or groups % self.size):
            raise ValueError(f"--cp-comm-type a2a splits the heads over the context-parallel "
                             f"group: each TP rank's {heads} attention heads and {groups} "
                             f"query groups must be divisible by --context-parallel-size "
                             f"{self.size} (use --cp-comm-type p2p or all_gather)")

    def seq_len(self, local_len: int) -> int:
        return local_len * self.size

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions ``(local_len,)`` of this rank's ``local_len`` tokens."""
        return torch.cat([s.positions(device) for s in  # made on the device: no host copy
                          segments(local_len * self.size, self.size, self.rank, self.layout)])

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  dropout_p: float = 0.0, head_offset: int = 0) -> torch.Tensor:
        """Causal attention of this rank's tokens over the whole sequence: ``q``
        ``(B, nh, T / C, hs)``, ``k``, ``v`` ``(B, ng, T / C, hs)`` -> ``(B, nh, T / C, hs)``.
        ``head_offset``: the global index of the first local head (TP), for dropout."""
        seed = draw_dropout_seed() if dropout_p > 0 else 0
        return self._attend(q, k, v, dropout_p, seed, head_offset)

    def mean_loss(self, losses: torch.Tensor, loss_mask: torch.Tensor | None = None):
        """The mean of per-token ``losses`` ``(B, T / C)`` over the whole sequence (every
        CP rank's tokens; with ``loss_mask`` over the tokens it keeps), the same scalar
        on every CP rank: one all-reduce of [sum, count] over the CP group."""
        if loss_mask is None:
            total = sum_over_group(losses.sum().reshape(1), self.group)
            return total[0] / (losses.numel() * self.size)
        both = torch.stack([(losses * loss_mask).sum(), loss_mask.sum().to(losses.dtype)])
        total = sum_over_group(both, self.group)
        return total[0] / total[1].clamp(min=1)  # only end-of-document tokens: 0, not 0 / 0

    def _spec(self, q, k, dropout_p, seed, first_head) -> Spec:
        return Spec(q.shape[-1] ** -0.5, q.shape[1] // k.shape[1], dropout_p, seed, first_head)

    def _exchange(self, q, k, v, dropout_p, seed, head_offset):
        spec = self._spec(q, k, dropout_p, seed, head_offset)
        return self._exchange_fn.apply(q, k, v, self.group, self.seq_len(q.shape[2]),
                                       self.layout, spec)

    def _all_to_all(self, q, k, v, dropout_p, seed, head_offset):
        if dropout_p == 0:
            attend = sdpa_causal
        else:
            first = head_offset + self.rank * (q.shape[1] // self.size)

            def attend(qh, kh, vh):
                return LocalAttention.apply(qh, kh, vh, self._spec(qh, kh, dropout_p, seed, first))
        return ulysses_attention(q, k, v, self.group, self.layout, attend)
