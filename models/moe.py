"""A mixture-of-experts MLP: a router sends each token to ``top_k`` of ``num_experts``
expert MLPs and sums their outputs, weighted by its gates.

    moe = MoE(hidden=64, ffn=128, num_experts=8, top_k=2)
    y, routing = moe(x)                # x: (..., hidden); y: x's shape
    loss = lm_loss + 1e-2 * switch_aux_loss(routing)

This is the layer on one process: every expert lives here. Expert parallelism (the
experts split over ranks, tokens sent to them by all-to-all) comes from outside, as TP
does for the dense MLP; the layer is written so that only the middle step changes
(see [Note: three steps]).

[Note: three steps]
1. **Route.** The router's logits ``(T, E)`` (a bias-free linear layer) become gates.
   Megatron's default (and Mixtral's): the top k logits of each token, then a softmax
   over those k (the gates sum to 1). ``pre_softmax``: a softmax over all E, then its top
   k (the gates sum to less than 1; Megatron's ``--moe-router-pre-softmax``).
   ``score="sigmoid"`` (DeepSeek-V3's): a sigmoid of each logit; the top k are chosen on
   the scores plus an expert bias that no gradient trains (aux-loss-free balancing,
   :meth:`models.router.Router.update_expert_bias`), and the gates are the chosen unbiased scores
   scaled to sum to 1. Top k is a stable descending sort, so equal scores go to the
   lower expert index: the choice never depends on the kernel's tie order, hence never
   on the layout.
2. **Compute.** The T x k (token, expert) assignments are sorted by expert, stably (a
   token's assignments keep the token order within an expert), and each expert runs its
   MLP on its rows, each projection one grouped matrix multiply
   (:func:`hybrid.kernels.grouped_linear.grouped_linear`, a loop in expert order). An
   expert with no rows is skipped; its weights get a zero gradient.
3. **Combine.** Each assignment's output goes back to its token, and the k outputs of a
   token are summed in the order of its gates (largest first), each times its gate: one
   fixed order of additions, whatever the batch or the layout.

The routing losses are :mod:`models.moe_losses`'s; the router :mod:`models.router`'s.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.experts import run_experts
from hybrid.tensor_parallel.mappings import sequence_parallel_param
from hybrid.tensor_parallel.sharding import mark_expert_split
from hybrid.tensor_parallel.token_split import TokenSplit
from hybrid.tensor_parallel.weight_grad import (
    WeightGradStore,
    deferrable_grouped_linear,
    deferrable_linear,
)
from models.moe_losses import (
    GlobalCounts,
    global_aux_loss,
    router_z_loss,
    seq_aux_loss,
    switch_aux_loss,
)
from models.router import SCORES, Router, Routing

__all__ = ["BALANCING", "DROP_POLICIES", "SCORES", "AuxLossScale", "GlobalCounts", "MoE",
           "MoELayer", "MoEStats", "Router", "Routing", "SharedExpert", "global_aux_loss",
           "router_z_loss", "seq_aux_loss", "switch_aux_loss"]


DROP_POLICIES = ("probs", "position")
BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def _init(weights, std: float) -> None:
    """Normal(0, std) draws for a layer built on its own (a model draws its parameters by
    name afterwards, :func:`hybrid.tensor_parallel.init_parameters`); none on the meta
    device, where only shapes exist."""
    for w in weights:
        if w.device.type != "meta":
            nn.init.normal_(w, std=std)


class MoE(nn.Module):
    """``num_experts`` MLPs (``hidden`` -> ``ffn`` -> ``hidden``, GELU; ``swiglu``: the
    gated SiLU pair) behind a :class:`Router`. The experts' weights are stacked, expert
    first (``fc``: ``(E, parts x ffn, hidden)``, ``proj``: ``(E, hidden, ffn)``), so that
    an expert-parallel rank's experts are one slice of each.

    ``capacity_factor`` None: dropless (every assignment computed). Else each expert
    takes at most ``ceil(T x k / E x capacity_factor)`` of a batch's T x k assignments
    and the rest are dropped (they add nothing; the residual carries the token), kept
    by ``drop_policy``: "probs", the largest gates, or "position", the earliest tokens;
    equal gates keep the earlier assignment. Megatron's ``--moe-expert-capacity-factor``
    and ``--moe-token-drop-policy``.

    ``ep_group``: the experts split over an expert-parallel group, this rank holding
    experts ``[r E / EP, (r + 1) E / EP)`` (``fc`` and ``proj`` hold those, marked
    ``ep_spec``); the router stays whole, and each assignment runs on its expert's rank
    (:func:`hybrid.tensor_parallel.experts.run_experts`). None: every expert here.
    ``etp_group``: each expert's ``ffn`` hidden units split over it (expert tensor
    parallelism): ``fc`` holds this rank's ``ffn / ETP`` rows of each part, ``proj`` its
    columns, and an expert's rows from every rank of the group run here, their partial
    outputs summed back (:func:`hybrid.tensor_parallel.experts.run_sharded`).

    ``split``: the ranks holding the rest of this micro-batch's tokens (sequence
    parallelism's TP group, the CP group; :class:`hybrid.tensor_parallel.token_split.
    TokenSplit`), ``x`` then ``(B, T_local, hidden)``: each rank routes its own tokens,
    and a capacity is decided on the whole micro-batch's choices, gathered, as one
    process decides it. None: ``x`` is the whole micro-batch."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *,
                 swiglu: bool = False, pre_softmax: bool = False, score: str = "softmax",
                 topk_scaling: float | None = None, capacity_factor: float | None = None,
                 drop_policy: str = "probs", init_method_std: float = 0.02,
                 ep_group: CommGroup | None = None, groups: tuple[int, int] | None = None,
                 split: TokenSplit | None = None, etp_group: CommGroup | None = None,
                 weight_grads: WeightGradStore | None = None):
        super().__init__()
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (None: dropless), got "
                             f"{capacity_factor}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy {drop_policy!r} must be one of {DROP_POLICIES}")
        parts = 2 if swiglu else 1
        self.swiglu, self.num_experts = swiglu, num_experts
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        ep = ep_group.size if ep_group is not None else 1
        if num_experts % ep:
            raise ValueError(f"num_experts {num_experts} is not divisible by the "
                             f"expert-parallel size {ep}")
        etp = etp_group.size if etp_group is not None else 1
        if ffn % etp:
            raise ValueError(f"the experts' hidden size {ffn} is not divisible by the "
                             f"expert-tensor-parallel size {etp}")
        self.ep, self.etp = ep_group, etp_group if etp > 1 else None
        self.weight_grads = weight_grads
        local = num_experts // ep
        self.split = split
        self.router = Router(hidden, num_experts, top_k, pre_softmax, score, topk_scaling,
                             groups, sp=None if split is None else split.tp)
        self.fc = nn.Parameter(torch.empty(local, parts * ffn // etp, hidden))
        self.proj = nn.Parameter(torch.empty(local, hidden, ffn // etp))
        if ep * etp > 1:
            rank = ep_group.rank if ep_group is not None else 0
            t = etp_group.rank if etp_group is not None else 0
            # under ETP: fc seen as (E x parts) rows of ffn x hidden, proj as (E x hidden)
            # rows of ffn, each rank's rows cut into ETP column chunks
            mark_expert_split(self.fc, (num_experts, parts * ffn, hidden), rank, ep,
                              (num_experts * parts, t, etp) if etp > 1 else None)
            mark_expert_split(self.proj, (num_experts, hidden, ffn), rank, ep,
                              (num_experts * hidden, t, etp) if etp > 1 else None)
        _init((self.router.weight, self.fc, self.proj), init_method_std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """``x``: ``(..., hidden)`` -> (the same shape, the batch's :class:`Routing`, with
        ``kept`` set under a capacity)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens)
        k = routing.experts.shape[1]
        flat = routing.experts.reshape(-1)
        gates = routing.gates
        assignments = torch.arange(flat.numel(), device=flat.device)
        if self.capacity_factor is not None:
            kept = (self._kept(routing.experts, routing.gates) if self.split is None
                    else self._kept_over_split(routing, shape[0]))
            routing = replace(routing, kept=kept)
            assignments = assignments[kept.reshape(-1)]
            gates = gates * kept
        # 2. compute: the assignments sorted by expert (stably), each expert's rows at once
        order = assignments[torch.sort(flat[assignments], stable=True).indices]
        counts = torch.bincount(flat[order], minlength=self.num_experts)
        rows = tokens[order // k]
        experts = self._experts()
        if (self.ep is None or self.ep.size == 1) and self.etp is None:
            out = experts(rows, counts.tolist())
        else:  # each assignment on its expert's rank(s), and back
            out = run_experts(rows, counts, self.ep, experts, self.etp)
        # 3. combine: back to (T, k) in gate order, each times its gate, summed in that order
        per_assignment = tokens.new_zeros(flat.numel(), shape[-1])
        per_assignment[order] = out
        per_assignment = per_assignment.view(-1, k, shape[-1])
        y = per_assignment[:, 0] * gates[:, :1]
        for j in range(1, k):
            y = y + per_assignment[:, j] * gates[:, j: j + 1]
        return y.view(shape), routing

    def _kept(self, experts: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``(T, k)`` bool: of the T tokens' chosen ``experts`` ``(T, k)`` with their
        ``gates``, the assignments within their expert's capacity (class doc)."""
        t, k = experts.shape
        assert self.capacity_factor is not None  # (called under a capacity)
        capacity = math.ceil(t * k / self.num_experts * self.capacity_factor)
        flat = experts.reshape(-1)
        if self.drop_policy == "probs":  # largest gate first, equal gates in order
            priority = torch.sort(gates.detach().reshape(-1), descending=True,
                                  stable=True).indices
        else:
            priority = torch.arange(flat.numel(), device=flat.device)
        # grouped by expert, each group in priority order: a place's rank in its group
        grouped = priority[torch.sort(flat[priority], stable=True).indices]
        counts = torch.bincount(flat, minlength=self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[grouped]]
        kept = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        kept[grouped] = rank < capacity
        return kept.view(t, k)

    def _kept_over_split(self, routing: Routing, batch: int) -> torch.Tensor:
        """:meth:`_kept` of this rank's tokens, decided on the whole micro-batch: every
        rank's choices gathered over the split, put in the one-process token order,
        and this rank's rows of the answer taken (the same drops at every layout)."""
        assert self.split is not None
        t = routing.experts.shape[0]
        ids = self.split.token_ids(batch, t // batch, routing.experts.device)
        every = self.split.gather(ids)
        experts, gates = (torch.empty((every.numel(), r.shape[1]), dtype=r.dtype,
                                      device=r.device)
                          for r in (routing.experts, routing.gates))
        experts[every] = self.split.gather(routing.experts)
        gates[every] = self.split.gather(routing.gates)
        return self._kept(experts, gates)[ids]

    def _experts(self):
        """``experts(rows, counts)``: each local expert's MLP on its run of ``rows`` (sorted
        by expert, ``counts`` each), the up and down projections each one grouped matrix
        multiply (:func:`hybrid.tensor_parallel.weight_grad.deferrable_grouped_linear`:
        under a zero-bubble schedule's split backward the stacks' gradients wait for
        its weight half, as the linears' do) and the activation over all rows at once.
        The stacked weights are split once a forward: indexing them per expert would
        make each expert's backward a zero-filled gradient of the whole stack (E of them
        added, O(E^2) traffic); one split's backward stacks the E gradients once."""
        fc: torch.Tensor = self.fc
        proj: torch.Tensor = self.proj
        if (self.ep is None or self.ep.size == 1) and self.etp is None \
                and self.split is not None:
            # every expert on every TP rank, each running its own tokens: the gradient
            # summed over TP, as a norm's under SP (over EP > 1 the exchange brings every
            # rank's tokens to the expert instead)
            fc, proj = _replicated(fc, self.split.tp), _replicated(proj, self.split.tp)
        store = self.weight_grads

        def experts(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
            h = deferrable_grouped_linear(rows, counts, fc, store)
            return deferrable_grouped_linear(_activation(h, self.swiglu), counts, proj, store)
        return experts


class AuxLossScale:
    """What the step's backward multiplies a micro-batch's loss by (``1 / n`` micro-batches
    times the fp16 loss scale): one per model, shared by its MoE layers, which inject
    their losses' gradients times it ([Note: the MoE losses' gradient]). Set by the step
    before its first forward (:func:`hybrid.train.step.train_step`); 1 when never set,
    which is a plain ``loss.backward()`` of one micro-batch's loss."""

    def __init__(self) -> None:
        self.value = 1.0


class MoEStats:
    """What one MoE layer's routing did since the last :meth:`take`, counted once per
    micro-batch's backward ([Note: the MoE losses' gradient]): the tokens each expert
    got (assignments, ``(E,)`` int64), the assignments a capacity dropped, the sums of
    the aux and z losses (unweighted) and the micro-batches counted. Kept as tensors on
    the layer's device (no host sync until :meth:`take`)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._sums: torch.Tensor | None = None  # [dropped, aux, z] in fp64
        self._counts: torch.Tensor | None = None
        self.micro_batches = 0

    def add(self, counts: torch.Tensor, sums: torch.Tensor) -> None:
        if self._counts is None or self._sums is None:
            self._counts, self._sums = counts.clone(), sums.clone()
        else:
            self._counts += counts
            self._sums += sums
        self.micro_batches += 1

    def take_row(self, device: torch.device) -> torch.Tensor:
        """The counts so far as one fp64 row on ``device`` (no host sync): tokens per expert
        ``(E,)``, then the sums of dropped, aux and z, then the micro-batches; then zero."""
        counts = (torch.zeros(self.num_experts, dtype=torch.float64, device=device)
                  if self._counts is None else self._counts.to(device, torch.float64))
        sums = (torch.zeros(3, dtype=torch.float64, device=device) if self._sums is None
                else self._sums.to(device, torch.float64))
        micro = torch.full((1,), float(self.micro_batches), dtype=torch.float64, device=device)
        self._sums = self._counts = None
        self.micro_batches = 0
        return torch.cat([counts, sums, micro])

    def take(self) -> dict:
        """The counts so far (``tokens_per_expert``, an ``(E,)`` int64 tensor on the host;
        ``dropped``; the mean ``aux`` and ``z`` per micro-batch; ``micro_batches``), then
        zero."""
        row = self.take_row(torch.device("cpu")).tolist()
        e, n = self.num_experts, max(int(row[-1]), 1)
        return {"tokens_per_expert": torch.tensor(row[:e], dtype=torch.int64),
                "dropped": int(row[e]), "aux": row[e + 1] / n, "z": row[e + 2] / n,
                "micro_batches": int(row[-1])}


def _replicated(weight: torch.Tensor, sp: CommGroup | None) -> torch.Tensor:
    """A weight whole on every TP rank used on this rank's tokens: under sequence
    parallelism (``sp``) its gradient is summed over TP (f on the parameter)."""
    return weight if sp is None else sequence_parallel_param(weight, sp)


def _activation(h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """An expert's activation of its up-projection ``h`` ``(n, parts x f)``: GELU, or the
    gated SiLU pair ``silu(gate) * up``."""
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


class SharedExpert(nn.Module):
    """An expert every token goes through (Megatron's shared expert): ``fc``
    ``(parts x ffn, hidden)``, ``proj`` ``(hidden, ffn)``, no biases. ``gated``: its
    output times ``sigmoid(x @ gate.T)``, ``gate`` ``(1, hidden)`` (Qwen2-MoE's,
    Megatron's ``moe_shared_expert_gate``); else ungated. ``sp``: as :class:`Router`'s
    (the weights whole on every TP rank, each running its own tokens). ``weight_grads``:
    the model's store, which a zero-bubble schedule's split backward defers ``fc``'s and
    ``proj``'s gradients to (:mod:`hybrid.tensor_parallel.weight_grad`)."""

    def __init__(self, hidden: int, ffn: int, swiglu: bool, init_method_std: float = 0.02,
                 gated: bool = False, sp: CommGroup | None = None,
                 weight_grads: WeightGradStore | None = None):
        super().__init__()
        self.swiglu, self.sp, self.weight_grads = swiglu, sp, weight_grads
        self.fc = nn.Parameter(torch.empty((2 if swiglu else 1) * ffn, hidden))
        self.proj = nn.Parameter(torch.empty(hidden, ffn))
        self.gate = nn.Parameter(torch.empty(1, hidden)) if gated else None
        _init([w for w in (self.fc, self.proj, self.gate) if w is not None], init_method_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        store = self.weight_grads
        h = deferrable_linear(x, _replicated(self.fc, self.sp), store)
        y = deferrable_linear(_activation(h, self.swiglu), _replicated(self.proj, self.sp),
                              store)
        if self.gate is None:
            return y
        return y * torch.sigmoid(F.linear(x, _replicated(self.gate, self.sp)))


class _AttachLosses(torch.autograd.Function):
    """Identity on ``y``; in backward, the gradient of ``loss`` is ``scale`` (the step's
    factor) and the routing's statistics are counted ([Note: the MoE losses' gradient])."""

    @staticmethod
    def forward(ctx, y, loss, scale: AuxLossScale, stats: MoEStats,
                record: tuple[torch.Tensor, torch.Tensor]):
        ctx.scale, ctx.stats, ctx.record = scale, stats, record
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        ctx.stats.add(*ctx.record)
        grad = torch.full((), ctx.scale.value, dtype=torch.float32, device=dy.device)
        return dy, grad, None, None, None


class MoELayer(nn.Module):
    """A block's MLP as a mixture of experts (:class:`MoE`), with an optional shared
    expert every token also goes through, and the routing's losses: ``aux_coeff`` times
    the load-balancing loss (``balancing``: "aux_loss", :func:`switch_aux_loss` over the
    micro-batch's tokens; "seq_aux_loss", :func:`seq_aux_loss` per sequence;
    "global_aux_loss", :func:`global_aux_loss` with the step's running counts over
    ``dp_group`` too; "none") plus ``z_coeff`` times :func:`router_z_loss`. ``(B, T, C)``
    in and out.

    [Note: the MoE losses' gradient]
    A layer's losses are not added to the model's output: under a pipeline the layer's
    stage is not the one computing the loss, and under activation checkpointing the
    forward that builds a graph is the recompute inside backward. So each is attached to
    the layer's output by an identity whose backward gives the losses the gradient the
    step gives the main loss, ``scale.value`` (:class:`AuxLossScale`): the same gradient
    as adding them to every micro-batch's loss, at any PP size, with or without
    recompute. The statistics are counted in that backward too, which runs once per
    micro-batch whether the forward ran once or twice; evaluation counts nothing."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *,
                 swiglu: bool, scale: AuxLossScale, balancing: str = "aux_loss",
                 aux_coeff: float = 0.0, z_coeff: float | None = None,
                 shared_ffn: int | None = None, shared_gate: bool = False,
                 dp_group: CommGroup | None = None, **moe_kw):
        super().__init__()
        if balancing not in BALANCING:
            raise ValueError(f"balancing {balancing!r} must be one of {BALANCING}")
        self.experts = MoE(hidden, ffn, num_experts, top_k, swiglu=swiglu, **moe_kw)
        split = self.experts.split
        self.shared = (SharedExpert(hidden, shared_ffn, swiglu, gated=shared_gate,
                                    sp=None if split is None else split.tp,
                                    weight_grads=self.experts.weight_grads)
                       if shared_ffn else None)
        self.balancing, self.aux_coeff, self.z_coeff = balancing, aux_coeff, z_coeff
        self.scale = scale
        self.stats = MoEStats(num_experts)
        self.global_counts = (GlobalCounts(num_experts, dp_group)
                              if balancing == "global_aux_loss" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, routing = self.experts(x)
        if self.shared is not None:
            y = y + self.shared(x)
        if not (self.training and torch.is_grad_enabled()):
            return y
        loss = routing.logits.new_zeros(())
        aux = z = routing.logits.new_zeros(())
        split = self.experts.split
        if self.balancing == "aux_loss":
            aux = switch_aux_loss(routing, split)
        elif self.balancing == "seq_aux_loss":
            aux = seq_aux_loss(routing, x.shape[0], split)
        elif self.global_counts is not None:
            aux = global_aux_loss(routing, self.global_counts, split)
        if self.aux_coeff and self.balancing != "none":
            loss = loss + self.aux_coeff * aux
        if self.z_coeff is not None:
            z = router_z_loss(routing, split)
            loss = loss + self.z_coeff * z
        dropped = (torch.zeros((), device=x.device) if routing.kept is None
                   else (~routing.kept).sum())
        sums = torch.stack([dropped.double(), aux.detach().double(), z.detach().double()])
        record = (routing.tokens_per_expert.detach(), sums)
        return _AttachLosses.apply(y, loss, self.scale, self.stats, record)
