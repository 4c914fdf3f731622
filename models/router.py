"""An MoE layer's router: hidden -> E logits -> each token's top-k experts and gates
(:class:`Router`, [Note: three steps] in :mod:`models.moe`), and what it decided for a
batch (:class:`Routing`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.mappings import sequence_parallel_param


@dataclass(frozen=True)
class Routing:
    """What the router decided for a batch of T tokens, E experts, k per token.

    ``experts``: ``(T, k)`` the chosen experts, largest score first; ``gates``: ``(T, k)``
    their weights; ``logits``: ``(T, E)``, fp32 at least; ``probs``: ``(T, E)`` a softmax over all E
    logits (the aux loss's); ``tokens_per_expert``: ``(E,)`` assignments each expert got
    (int64)."""

    experts: torch.Tensor
    gates: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor
    tokens_per_expert: torch.Tensor
    kept: torch.Tensor | None = None  # (T, k) under a capacity: the assignments computed


SCORES = ("softmax", "sigmoid")


class Router(nn.Module):
    """hidden -> E logits, without bias; :meth:`forward` gives a :class:`Routing`.
    ``score``: one of :data:`SCORES` ([Note: three steps]); with "sigmoid" the buffer
    ``expert_bias`` (E,) moves the choice, never the gates. ``sp``: the TP group when
    sequence parallelism gives this rank its own tokens (the weight's gradient is then
    summed over it, as a norm's is)."""

    expert_bias: torch.Tensor  # (a buffer)

    def __init__(self, hidden: int, num_experts: int, top_k: int,
                 pre_softmax: bool = False, score: str = "softmax",
                 topk_scaling: float | None = None, groups: tuple[int, int] | None = None,
                 sp: CommGroup | None = None):
        super().__init__()
        self.sp = sp
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts {num_experts}]")
        if groups is not None:
            n, pick = groups
            if num_experts % n or not 1 <= pick <= n or top_k % pick \
                    or top_k // pick > num_experts // n:
                raise ValueError(f"groups {groups}: the experts must split into {n} groups, "
                                 f"of which {pick} hold the top {top_k}, as many in each")
        self.groups = groups
        if score not in SCORES:
            raise ValueError(f"score {score!r} must be one of {SCORES}")
        if score == "sigmoid" and pre_softmax:
            raise ValueError("pre_softmax is a softmax router's: not with score='sigmoid'")
        self.num_experts, self.top_k, self.pre_softmax = num_experts, top_k, pre_softmax
        self.score, self.topk_scaling = score, topk_scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> Routing:
        """``x``: ``(T, hidden)``."""
        weight = self.weight if self.sp is None else sequence_parallel_param(self.weight, self.sp)
        logits = F.linear(x, weight)
        if logits.dtype in (torch.bfloat16, torch.float16):  # routing decided in fp32
            logits = logits.float()
        probs = torch.softmax(logits, dim=-1)
        if self.score == "sigmoid":
            scores = torch.sigmoid(logits)
            # the bias only ranks; its sort key has no gradient ([Note: three steps])
            _, experts = torch.sort(self._in_groups(scores.detach() + self.expert_bias),
                                    dim=-1, descending=True, stable=True)
            experts = experts[:, : self.top_k]
            top = scores.gather(1, experts)
            gates = top / top.sum(dim=-1, keepdim=True)
        else:
            # a stable sort: equal scores keep the lower expert index first
            top, experts = torch.sort(self._in_groups(probs if self.pre_softmax else logits),
                                      dim=-1, descending=True, stable=True)
            top, experts = top[:, : self.top_k], experts[:, : self.top_k]
            gates = top if self.pre_softmax else torch.softmax(top, dim=-1)
        if self.topk_scaling is not None:  # (DeepSeek's routed scaling factor)
            gates = gates * self.topk_scaling
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        return Routing(experts, gates.to(x.dtype), logits, probs, counts)

    def _in_groups(self, key: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (DeepSeek's device- and node-limited routing, Megatron's
        ``--moe-router-num-groups G --moe-router-group-topk P``): the experts in G equal
        groups, a group scored by the sum of its top ``k / P`` keys, the key of every
        expert outside a token's best P groups -inf, so its top k come from those groups.
        Equal group scores go to the lower group (a stable sort). Without groups: ``key``."""
        if self.groups is None:
            return key
        n, pick = self.groups
        T = key.shape[0]
        per_group = key.view(T, n, -1)
        score = per_group.topk(self.top_k // pick, dim=-1).values.sum(dim=-1)
        best = torch.sort(score.detach(), dim=-1, descending=True, stable=True).indices
        keep = torch.zeros((T, n), dtype=torch.bool, device=key.device)
        keep.scatter_(1, best[:, :pick], True)
        return key.masked_fill(~keep.repeat_interleave(self.num_experts // n, dim=1),
                               float("-inf"))

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing (arXiv 2408.15664, DeepSeek-V3): each expert's bias
        moves by ``rate`` toward the mean load, up when it got fewer assignments than
        the mean, down when more (the sign of the difference), after an optimizer step
        with the step's summed counts."""
        load = tokens_per_expert.to(self.expert_bias.dtype)
        self.expert_bias += rate * torch.sign(load.mean() - load)
