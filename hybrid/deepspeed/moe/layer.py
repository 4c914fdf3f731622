"""``deepspeed.moe.layer.MoE``: DeepSpeed's mixture-of-experts layer, with its arguments,
its parameter names and its numbers.

    moe = MoE(hidden_size=84, expert=nn.Linear(84, 84), num_experts=4, ep_size=2, k=1)
    out, l_aux, exp_counts = moe(x)        # x: (..., hidden_size); out: x's shape

The layer holds ``num_experts / ep_size`` copies of ``expert`` (deep copies, so they start
equal, as DeepSpeed's) and a gate (:class:`~hybrid.deepspeed.moe.gating.TopKGate`,
[Note: the gatings] there). ``deepspeed.initialize`` gives it its expert-parallel group
(:func:`hybrid.deepspeed.moe.utils.attach_expert_groups`): EP rank ``r`` holds global
experts ``[r L, (r + 1) L)`` for ``L`` local experts, and the group is consecutive ranks,
as DeepSpeed's ``ep_size_<N>`` groups.

[Note: the forward]
1. The gate routes the S = prod(x.shape[:-1]) tokens: per route, a slot in an (E, C, M)
   buffer of each expert's C rows, and a weight.
2. The buffer is filled by index (a dropped route fills nothing) and, at EP > 1, its
   E / EP-expert blocks go to their ranks by one all-to-all over the EP group
   (:func:`hybrid.tensor_parallel.experts.exchange_blocks`: through the comm door).
3. Each local expert runs on its C rows from every EP rank at once, ``(EP, C, M)``.
4. The reverse all-to-all brings the rows home, and each token's output is the sum of
   its routes' rows times their weights (a dropped token's output is 0).
``use_residual`` (Residual MoE / PR-MoE): ``expert`` itself also runs, as a dense MLP on
every token, and a learnt softmax over two coefficients mixes the two outputs.

The expert parameters are marked as DeepSpeed's (``allreduce = False``, ``group_name``):
hybrid's engine sums their gradients over the expert data-parallel group (the ranks
holding the same experts) and shards their optimizer states over it, where the dense
parameters use the whole DP group.
"""

from __future__ import annotations

import copy
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.deepspeed.missing import refuse
from hybrid.deepspeed.moe.gating import Routes, TopKGate
from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.experts import exchange_blocks

__all__ = ["MoE"]


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert`` (``deepspeed_experts``), their
    parameters marked as experts of ``expert_group_name``. ``forward(x (EP, L, C, M))``:
    local expert ``i`` on ``x[:, i]``, outputs stacked the same way."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1,
                 expert_group_name: str | None = None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for p in module.parameters():  # (attributes of the tensor, as DeepSpeed's)
                p.allreduce = False  # type: ignore[attr-defined]
                p.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for chunk, module in zip(x.chunk(self.num_local_experts, dim=1),
                                 self.deepspeed_experts):
            out = module(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)  # (a bias term: dropped)
        return torch.cat(outs, dim=1)


class MOELayer(nn.Module):
    """The gate, the experts and the exchange between them ([Note: the forward]).
    ``l_aux`` and ``exp_counts`` hold the last forward's."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int,
                 num_local_experts: int):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group_name, self.ep_size = ep_group_name, ep_size
        self.num_local_experts = num_local_experts
        self.ep_group: CommGroup | None = None
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def _set_ep_group(self, ep_group: CommGroup) -> None:
        if ep_group.size != self.ep_size:
            raise ValueError(f"deepspeed.moe: an EP group of {ep_group.size} ranks for a "
                             f"layer of ep_size {self.ep_size}")
        self.ep_group = ep_group
        self.gate.ep_group = ep_group

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None
                ) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"deepspeed.moe.layer.MoE(ep_size={self.ep_size}) has no expert-parallel "
                f"group yet: pass the model to deepspeed.initialize before its forward")
        M = x.shape[-1]
        rows = x.reshape(-1, M)
        routes = self.gate(rows, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        buf = _dispatch(rows, routes)
        if self.ep_group is not None:
            buf = exchange_blocks(buf, self.ep_group)
        out = self.experts(buf.view(self.ep_size, self.num_local_experts, -1, M))
        out = out.reshape(-1, M)
        if self.ep_group is not None:
            out = exchange_blocks(out, self.ep_group)
        return _combine(out, routes).reshape(x.shape).to(x.dtype)


def _dispatch(rows: torch.Tensor, routes: Routes) -> torch.Tensor:
    """The (E C, M) expert input: each kept route's token row at its slot, zeros in the
    free slots ([Note: routes, not one-hot tensors] in gating.py)."""
    k, S = routes.slots.shape
    slots = routes.num_experts * routes.capacity
    buf = rows.new_zeros(slots + 1, rows.shape[1])  # (+1: the dropped routes' scratch row)
    tokens = torch.arange(S, device=rows.device).expand(k, S).reshape(-1)
    buf = buf.index_put((routes.slots.reshape(-1),), rows[tokens])
    return buf[:slots]


def _combine(out: torch.Tensor, routes: Routes) -> torch.Tensor:
    """(S, M): each token's routes' rows of ``out`` (E C, M) times their weights, summed
    in route order (a dropped route reads the zero scratch row)."""
    padded = torch.cat([out, out.new_zeros(1, out.shape[1])])
    picked = padded[routes.slots]  # (k, S, M)
    weighted = picked * routes.weights.to(out.dtype).unsqueeze(-1)
    return weighted.sum(dim=0) if weighted.shape[0] > 1 else weighted[0]


class MoE(nn.Module):
    """DeepSpeed's MoE layer (module doc): DeepSpeed's arguments, ``forward(hidden_states,
    used_token=None)`` -> ``(output, l_aux, exp_counts)``.

    ``use_tutel`` is accepted and changes nothing (Tutel is a faster kernel for the same
    numbers, a CUDA package); ``enable_expert_tensor_parallelism`` is refused (hybrid's
    experts here run at TP 1)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1,
                 ep_size: int = 1, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"deepspeed.moe.layer.MoE: num_experts {num_experts} must be a "
                             f"multiple of ep_size {ep_size}")
        if enable_expert_tensor_parallelism:
            raise ValueError("deepspeed.moe.layer.MoE(enable_expert_tensor_parallelism="
                             "True): hybrid runs these experts at TP 1; leave it False")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size, self.num_experts = ep_size, num_experts
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_local_experts = num_experts // ep_size
        self.use_tutel = use_tutel
        # built in DeepSpeed's order (the experts copied, then the gate's and the
        # coefficients' weights drawn): a seeded script draws the same initial values
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                        min_capacity, noisy_gate_policy, drop_tokens, use_rts, None,
                        top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size,
                                      self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, ep_group: CommGroup) -> None:
        """Give the layer its EP group (``deepspeed.initialize`` does, from the engine's
        :class:`~hybrid.parallel.state.ParallelState`)."""
        self.deepspeed_moe._set_ep_group(ep_group)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Any, Any]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def __getattr__(name: str) -> NoReturn:
    refuse("moe.layer", name, "hybrid serves MoE from it")
