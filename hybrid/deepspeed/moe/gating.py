"""DeepSpeed's MoE gating (``deepspeed.moe.sharded_moe``' top-1, top-2 and top-k), as
routes: which expert slot each token's route fills and with what weight.

    gate = TopKGate(model_dim=84, num_experts=4, k=1)
    routes = gate(x)           # x: (S, model_dim); routes: a Routes

The numbers are DeepSpeed 0.19.8's: the same softmax, the same argmax and top-k calls on
the same tensors, the same random draws from torch's default generator in the same order
(so a seeded script routes as it does under DeepSpeed), the same capacity arithmetic.

[Note: the gatings]
* **Top-1** (Switch). The expert is the argmax of the softmax gates, or with
  ``noisy_gate_policy="RSample"`` (training only) the argmax of the logits plus Gumbel
  noise. ``l_aux`` = E * sum_e(mean gate_e * fraction routed to e). Capacity: each expert
  keeps at most C = max(ceil(S / E * capacity_factor), min_capacity) of its tokens;
  which ones, with random token selection (``use_rts``, the default), the C of largest
  uniform draw (one draw per (token, expert) entry), else the first C by ``torch.topk``
  over the 0/1 mask. The kept token's weight is its softmax gate, not renormalized.
* **Top-2** (GShard). First expert: the argmax of the gates; second: the argmax of the
  logits, plus Gumbel noise with ``top2_2nd_expert_sampling``, with the first masked
  out. ``l_aux`` = E^2 * mean_e(mean gate_e * fraction first-routed to e). Capacity
  2 x capacity_factor: a position per expert counts first routes before second ones,
  and a route past C is dropped; the two kept weights are renormalized to sum to 1.
* **Top-k** (k > 2). The top k gates; ``l_aux`` = E^2 / k * mean_e(mean gate_e *
  fraction routed to e); capacity k x capacity_factor, an expert keeping its C tokens
  of largest gate; weights renormalized over the kept routes.
* ``drop_tokens=False``: no capacity: C is the largest expert's count, taken as the
  maximum over the EP group (so every rank exchanges blocks of one size).

[Note: routes, not one-hot tensors]
DeepSpeed's gating returned (S, E, C) combine weights; this one returns, per route r and
token s, the flat slot ``e * C + position`` its row takes in the (E * C, M) expert input
and its weight. A dropped route points at the scratch slot ``E * C`` with weight 0. The
layer fills and reads the slots by index (memory O(E C M + S k), not O(S E C)), so the
sums are the one-hot products' sums with their zero terms left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions.gumbel import Gumbel
from torch.distributions.uniform import Uniform

from hybrid.parallel.comm import CommGroup

NOISY_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass(frozen=True)
class Routes:
    """A batch of S tokens routed to E experts of capacity C, k routes a token.

    ``slots``: ``(k, S)`` int64, the flat slot ``e * C + position`` of a kept route, ``E *
    C`` for a dropped one; ``weights``: ``(k, S)``, the route's combine weight (0 when
    dropped; differentiable to the gate); ``l_aux``: the load-balancing loss (0-dim);
    ``exp_counts``: ``(E,)`` int64, the routes each expert was given before capacity."""

    l_aux: torch.Tensor
    capacity: int
    num_experts: int
    slots: torch.Tensor
    weights: torch.Tensor
    exp_counts: torch.Tensor


def _capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    # DeepSpeed's product is a float32 tensor times the Python quotient: the same rounding
    c = math.ceil(float(torch.tensor(factor, dtype=torch.float32) * (tokens / experts)))
    return max(c, min_capacity)


def _largest_count(exp_counts: torch.Tensor, ep_group: CommGroup | None) -> int:
    """``drop_tokens=False``'s capacity: the largest expert count over the EP group."""
    biggest = exp_counts.max().reshape(1).clone()
    if ep_group is not None:
        ep_group.all_reduce(biggest, op=torch.distributed.ReduceOp.MAX)
    return int(biggest.item())  # (a shape: it must be on the host)


def _gumbel(shape: torch.Size, device: torch.device) -> torch.Tensor:
    return Gumbel(torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
                  ).rsample(shape)


def _uniform(shape: torch.Size, device: torch.device, low: float, high: float
             ) -> torch.Tensor:
    return Uniform(torch.tensor(low, device=device), torch.tensor(high, device=device)
                   ).rsample(shape)


def _as_routes(l_aux: torch.Tensor, capacity: int, keep: torch.Tensor,
               position: torch.Tensor, weight: torch.Tensor, exp_counts: torch.Tensor,
               k: int) -> Routes:
    """Routes from per-(token, expert) tensors of k chosen entries a token at most:
    ``keep`` (S, E) bool, ``position`` (S, E) the slot within the expert, ``weight``
    (S, E). A token's routes are its kept experts in expert order, padded to k with
    dropped routes."""
    E = keep.shape[1]
    # each token's kept experts first, in expert order (a stable sort of not-kept)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :k]
    kept = keep.gather(1, order)
    slots = torch.where(kept, order * capacity + position.gather(1, order),
                        torch.full_like(order, E * capacity))
    weights = weight.gather(1, order) * kept
    return Routes(l_aux, capacity, E, slots.t().contiguous(), weights.t().contiguous(),
                  exp_counts)


def top1(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
         used_token: torch.Tensor | None, noisy_gate_policy: str | None, drop_tokens: bool,
         use_rts: bool, ep_group: CommGroup | None) -> Routes:
    """Top-1 gating ([Note: the gatings]); ``logits`` (S, E) fp32."""
    S, E = logits.shape
    noisy = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" \
        else None
    gates = F.softmax(logits, dim=1)
    capacity = _capacity(S, E, capacity_factor, min_capacity)
    chosen = torch.argmax(noisy if noisy is not None else gates, dim=1)
    mask = F.one_hot(chosen, num_classes=E)
    if used_token is not None:
        mask = used_token.reshape(-1, 1) * mask
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = min(_largest_count(exp_counts, ep_group), S)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * E
    score = mask * _uniform(mask.shape, logits.device, 0.0, 1.0) if use_rts else mask
    if min_capacity > S:
        raise ValueError(f"deepspeed.moe top-1 gating: {S} tokens, fewer than min_capacity "
                         f"{min_capacity}; set min_capacity to 0 or give a larger batch")
    picked = torch.topk(score, k=min(capacity, S), dim=0).indices
    mask = mask * torch.zeros_like(mask).scatter_(0, picked, 1)
    position = torch.cumsum(mask, dim=0) - 1
    return _as_routes(l_aux, capacity, mask.bool(), position, gates * mask.float(),
                      exp_counts, 1)


def top2(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
         drop_tokens: bool, second_sampling: bool, ep_group: CommGroup | None) -> Routes:
    """Top-2 gating ([Note: the gatings]); ``logits`` (S, E) fp32."""
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=E)
    if second_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    mask2 = F.one_hot(torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1),
                      num_classes=E)
    pos1 = torch.cumsum(mask1, dim=0) - 1
    pos2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * E * E
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = _capacity(S, E, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(pos1, capacity)
        mask2 = mask2 * torch.lt(pos2, capacity)
    else:
        capacity = _largest_count(exp_counts, ep_group)
    g1 = (gates * mask1.float()).sum(dim=1)
    g2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    keep = torch.stack([mask1.bool(), mask2.bool()])  # (2, S, E): one entry a row at most
    slot = torch.stack([(mask1 * pos1).sum(dim=1), (mask2 * pos2).sum(dim=1)])
    expert = torch.stack([mask1.argmax(dim=1), mask2.argmax(dim=1)])
    kept = keep.any(dim=2)
    slots = torch.where(kept, expert * capacity + slot, torch.full_like(slot, E * capacity))
    weights = torch.stack([g1, g2]) * kept
    return Routes(l_aux, capacity, E, slots, weights, exp_counts)


def topk(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int,
         drop_tokens: bool, ep_group: CommGroup | None) -> Routes:
    """Top-k gating, k > 2 ([Note: the gatings]); ``logits`` (S, E) fp32."""
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * E * E / k
    if drop_tokens:
        capacity = _capacity(S, E, capacity_factor * k, min_capacity)
        chosen = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        best = torch.topk(chosen, k=min(capacity, S), dim=0, sorted=False).indices
        mask = mask & torch.zeros_like(mask).scatter_(0, best, True)
    else:
        capacity = _largest_count(exp_counts, ep_group)
    position = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True),
                                  min=torch.finfo(masked.dtype).eps)
    return _as_routes(l_aux, capacity, mask, position, masked, exp_counts, k)


class TopKGate(nn.Module):
    """DeepSpeed's gate: ``wg``, a bias-free linear layer model_dim -> num_experts, and
    the gating of ``k`` ([Note: the gatings]); ``forward(x (S, model_dim))`` -> Routes.
    The logits are fp32 whatever ``x``'s dtype; Jitter noise multiplies the input by
    U(0.99, 1.01) in training; RSample noise (top-1) and the capacity factor are the
    training ones in training, ``eval_capacity_factor`` and no noise in eval."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True,
                 ep_group: CommGroup | None = None, top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"deepspeed.moe: k={k} must be in [1, num_experts "
                             f"{num_experts}]")
        if noisy_gate_policy not in NOISY_POLICIES:
            raise ValueError(f"deepspeed.moe: noisy_gate_policy {noisy_gate_policy!r} must be "
                             f"one of {NOISY_POLICIES}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k, self.capacity_factor = k, capacity_factor
        self.eval_capacity_factor, self.min_capacity = eval_capacity_factor, min_capacity
        self.noisy_gate_policy, self.drop_tokens, self.use_rts = (noisy_gate_policy,
                                                                  drop_tokens, use_rts)
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> Routes:
        inp = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            inp = inp * _uniform(inp.shape, inp.device, 1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(inp, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1(logits, factor, self.min_capacity, used_token,
                        self.noisy_gate_policy if self.training else None, self.drop_tokens,
                        self.use_rts, self.ep_group)
        if self.k == 2:
            return top2(logits, factor, self.min_capacity, self.drop_tokens,
                        self.top2_2nd_expert_sampling, self.ep_group)
        return topk(logits, self.k, factor, self.min_capacity, self.drop_tokens,
                    self.ep_group)
