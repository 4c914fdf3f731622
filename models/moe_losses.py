"""The routing losses of an MoE layer: Switch's load-balancing loss, its per-sequence and
global-batch forms, and the router z-loss, each of one :class:`models.router.Routing`
(and, split over ranks, of the whole micro-batch: :mod:`hybrid.tensor_parallel.token_split`).

[Note: the load-balancing loss]
:func:`switch_aux_loss` is Switch Transformer's (Megatron's ``aux_loss``): E times the
sum over experts of (the fraction of the T x k assignments it got) times (its mean
router probability over the T tokens), with the probabilities of a softmax over all E
logits whatever ``pre_softmax`` says. It is 1 when routing is uniform, at least 1
otherwise up to rounding, and its gradient reaches the router through the mean
probabilities only (the counts are integers). :func:`router_z_loss` (ST-MoE's, Megatron's
``--moe-z-loss-coeff``) keeps the logits small: the mean over tokens of the squared
log-sum-exp of a token's logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel.mappings import sum_over_group
from hybrid.tensor_parallel.token_split import TokenSplit
from models.router import Routing


def switch_aux_loss(routing: Routing, split: TokenSplit | None = None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of one batch ([Note: the load-balancing
    loss]): 1 for uniform routing. A 0-dim fp32 tensor; multiply by the coefficient
    (Megatron's ``--moe-aux-loss-coeff``) and add to the loss. ``split``: ``routing`` is
    this rank's part of a batch split over those ranks; the loss is the whole batch's,
    its gradient through this rank's tokens (:mod:`hybrid.tensor_parallel.token_split`)."""
    probs, counts = routing.probs, routing.tokens_per_expert
    t, e = probs.shape
    k = routing.experts.shape[1]
    if split is None:
        mean = probs.mean(dim=0)
    else:
        t *= split.size
        counts, mean = split.total(counts), split.total(probs.sum(dim=0)) / t
    fraction = counts.to(probs.dtype) / (t * k)
    return e * (fraction * mean).sum()


def router_z_loss(routing: Routing, split: TokenSplit | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss of one batch ([Note: the load-balancing loss]): the mean over
    tokens of logsumexp(logits)^2, a 0-dim fp32 tensor; times Megatron's
    ``--moe-z-loss-coeff``. ``split``: as :func:`switch_aux_loss`'s."""
    z = torch.logsumexp(routing.logits, dim=-1).square()
    if split is None:
        return z.mean()
    return split.total(z.sum()) / (z.numel() * split.size)


def seq_aux_loss(routing: Routing, sequences: int, split: TokenSplit | None = None
                 ) -> torch.Tensor:
    """DeepSeek-V2's sequence-wise load-balancing loss (Megatron's ``seq_aux_loss``): the
    Switch loss of each of ``sequences`` equal runs of the T tokens (a sequence each),
    averaged over them. A 0-dim fp32 tensor, 1 for uniform routing. ``split``: as
    :func:`switch_aux_loss`'s (each rank holding part of every sequence)."""
    probs, experts = routing.probs, routing.experts
    t, e = probs.shape
    k = experts.shape[1]
    per = t // sequences
    counts = F.one_hot(experts.reshape(sequences, per * k), e).sum(dim=1)  # (S, E)
    if split is None:
        mean = probs.view(sequences, per, e).mean(dim=1)
    else:
        per *= split.size
        counts = split.total(counts)
        mean = split.total(probs.view(sequences, -1, e).sum(dim=1)) / per
    fraction = counts.to(probs.dtype) / (per * k)
    return e * (fraction * mean).sum(dim=1).mean()


class GlobalCounts:
    """The running tokens per expert of :func:`global_aux_loss` (Megatron's
    ``global_aux_loss``, after arXiv 2501.11873): each micro-batch's counts summed over
    the ranks running micro-batches side by side (the token split and DP), added up over
    the step's micro-batches so far, and averaged over them; :meth:`reset` at each
    optimizer step (:meth:`hybrid.train.moe_stats.MoEWatch.step`).

    [Note: the global loss's layout]
    Unlike the other losses, its value is not a micro-batch's alone: it weighs a
    micro-batch's router probabilities by the counts of every micro-batch run so far in
    the step, on every DP rank, so it depends on how many DP ranks share a step and in
    which order a rank's micro-batches run, as Megatron's does by definition. TP, CP, EP,
    ETP, the pipeline schedule, the ZeRO stage and recompute leave it as one process with
    the same micro-batches in the same order computes it (a recompute counts once: the
    first forward under checkpointing runs without a graph, and counts nothing)."""

    def __init__(self, num_experts: int, dp: CommGroup | None) -> None:
        self.dp, self.num_experts = dp, num_experts
        self.sum: torch.Tensor | None = None  # (made on the counts' device at the first add)
        self.micro_batches = 0

    def add(self, counts: torch.Tensor) -> torch.Tensor:
        """This micro-batch's ``(E,)`` counts (already summed over the token split) summed
        over DP and added; the running mean ``(E,)`` fp32 after it."""
        counts = counts.to(torch.float32).clone()
        if self.dp is not None:
            self.dp.all_reduce(counts)
        self.sum = counts if self.sum is None else self.sum + counts
        self.micro_batches += 1
        return self.sum / self.micro_batches

    def reset(self) -> None:
        self.sum = None
        self.micro_batches = 0


def global_aux_loss(routing: Routing, running: GlobalCounts,
                    split: TokenSplit | None = None) -> torch.Tensor:
    """The global-batch load-balancing loss ([Note: the global loss's layout]): Switch's
    formula with the expert fractions of the step's running mean counts (:class:`GlobalCounts`)
    over the tokens of every rank that shares the micro-batch (the split and DP), and the
    mean router probabilities over the same tokens, summed to every rank with the
    gradient through its own (:mod:`hybrid.tensor_parallel.token_split`). A 0-dim fp32
    tensor, 1 for uniform routing."""
    probs, counts = routing.probs, routing.tokens_per_expert
    t, e = probs.shape
    k = routing.experts.shape[1]
    summed = probs.sum(dim=0)
    if split is not None:
        t *= split.size
        counts, summed = split.total(counts), split.total(summed)
    if running.dp is not None:
        t *= running.dp.size
        summed = sum_over_group(summed, running.dp)
    fraction = running.add(counts) / (t * k)
    return e * (fraction * summed / t).sum()
