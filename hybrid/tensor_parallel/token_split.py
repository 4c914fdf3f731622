"""The ranks that hold parts of one micro-batch's tokens, for the MoE layers' statistics.

    split = TokenSplit(tp_group if sequence_parallel else None, cp)   # cp: ContextParallel
    counts = split.total(local_counts)            # (E,) over the whole micro-batch
    probs = split.total(local_probs.sum(0))       # the same, its gradient through local terms
    ids = split.token_ids(B, T_local, device)     # each local token's place in the batch

Sequence parallelism leaves a TP rank ``T / tp`` of every sequence's tokens between the
linears, context parallelism a CP rank ``T / cp`` of them (load-balanced chunks): an MoE
layer there routes only its own tokens. Routing is per token and needs nothing more;
but the load-balancing and z losses, the capacity and the token counts are defined on
the whole micro-batch (docs/moe.md), so a layer sums its per-expert terms over the
split's groups (:meth:`TokenSplit.total`: the TP group, then the CP group) and, under a
capacity, gathers every token's choice to decide the drops as one process would
(:meth:`TokenSplit.gather`, ordered by :meth:`TokenSplit.token_ids`).

[Note: a sum whose gradient stays local]
:meth:`TokenSplit.total` is :func:`~hybrid.tensor_parallel.mappings.sum_over_group`:
forward the sum, backward the identity. Every rank of the split computes the same loss
value, and its gradient reaches the rank's own tokens only; the router's gradient is
then summed over the split as every replicated parameter's is (over TP by f on the
sequence-parallel parameter, over CP by ZeRO's reduction over DP x CP), which makes the
whole micro-batch's gradient exactly once.
"""

from __future__ import annotations

import torch

from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.cp_attention import ContextParallel
from hybrid.tensor_parallel.mappings import sum_over_group


class TokenSplit:
    """``tp``: the TP group when sequence parallelism splits the tokens over it, else None;
    ``cp``: the model's :class:`ContextParallel`, or None. At least one is split."""

    def __init__(self, tp: CommGroup | None, cp: ContextParallel | None):
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.cp = cp
        self.groups = [g for g in (self.tp, None if cp is None else cp.group) if g is not None]
        self.size = (1 if self.tp is None else self.tp.size) * (1 if cp is None else cp.size)

    def __repr__(self) -> str:
        return f"TokenSplit(tp={None if self.tp is None else self.tp.size}, cp={self.cp})"

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over every rank of the split (TP, then CP); its backward the
        identity ([Note: a sum whose gradient stays local])."""
        for g in self.groups:
            x = sum_over_group(x, g)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` ``(n, ...)`` stacked along dim 0 (no gradient), the TP
        group's gathered first, then the CP group's: ``(size * n, ...)``, in an order
        :meth:`token_ids` gathered the same way gives."""
        x = x.detach().contiguous()
        for g in self.groups:
            out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))
            g.all_gather(out, x)
            x = out
        return x

    def token_ids(self, batch: int, local_len: int, device) -> torch.Tensor:
        """``(batch * local_len,)`` int64: where each of this rank's tokens (``(B, T
        local)`` flattened, row-major) sits in the micro-batch as one process holds it,
        ``b * T + t`` with ``t`` the token's position in its whole sequence."""
        pos = torch.arange(local_len, device=device)
        if self.tp is not None:  # SP: this TP rank's contiguous chunk (of the CP share)
            pos = pos + self.tp.rank * local_len
        cp_len = local_len * (1 if self.tp is None else self.tp.size)
        if self.cp is not None:
            pos = self.cp.positions(cp_len, device)[pos]
        seq = cp_len * (1 if self.cp is None else self.cp.size)
        rows = torch.arange(batch, device=device)[:, None] * seq
        return (rows + pos[None, :]).reshape(-1)
