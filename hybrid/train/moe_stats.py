"""What the MoE layers' routing did, step by step: the expert-bias update and the numbers
the log line shows.

    watch = MoEWatch(model, ps, moe_config)    # None-free: a dense model has no layers
    watch.step()                               # after each optimizer step
    watch.line()                               # at a log line: per layer, the interval's

Each step :meth:`MoEWatch.step` takes every local MoE layer's counts
(:class:`models.moe.MoEStats`: tokens per expert, dropped assignments, the aux and z
losses' sums, counted once per micro-batch) and sums them over the data-parallel group
(DP x CP, and TP, whose ranks route their own tokens under sequence parallelism)
in one all-reduce each (the ``(layers x (E + 3))`` fp64 vector), so every DP rank holds the
step's global counts. With ``--moe-router-enable-expert-bias`` each layer's router then
moves its expert bias by those counts (:meth:`models.moe.Router.update_expert_bias`):
alike on every DP rank, whose copies stay equal. The counts add up over the log
interval; :meth:`MoEWatch.line` sums them over the pipeline group too (each stage holds
other layers; zeros elsewhere), one all-reduce per log line, and gives per layer: the
mean aux and z loss per micro-batch, the fewest and most tokens an expert got per step,
and the dropped assignments per step.

[Note: no host sync in a step]
Everything a step does here stays on the device (the counts, their all-reduce, the bias
update, the interval's sums, minima and maxima): the values are read on the host at a
log line only, as the loss is. (The routing itself syncs, once per MoE layer and
micro-batch: the experts' row counts size their matmuls and the all-to-all's splits.)

The expert biases are model state the optimizer does not hold: :meth:`MoEWatch.buffers`
gives the whole model's (every stage's, by parameter-style name) for a checkpoint's
``metadata.json`` (``"buffers"``, written by rank 0: the biases are the same on every
DP and TP rank), and :meth:`MoEWatch.load_buffers` puts a loaded checkpoint's back into
this stage's layers, at any pipeline size.
"""

from __future__ import annotations

import torch

from hybrid.checkpoint.save import gather_json
from hybrid.config.moe import MoEConfig
from hybrid.errors import CheckpointError
from hybrid.parallel.state import ParallelState
from models.gpt import GPT


class MoEWatch:
    """The MoE layers of ``model`` (this stage's) over ``ps``'s DP and PP groups."""

    def __init__(self, model: GPT, ps: ParallelState, moe: MoEConfig):
        self.layers = model.moe_layers()  # global layer index -> MoELayer
        self.ps, self.moe = ps, moe
        self.num_layers = model.cfg.num_layers
        self.experts = moe.num_experts or 0
        self.steps = 0
        # per global layer: [tokens per expert (E), dropped, aux sum, z sum, micro-batches],
        # on the device: a step reads no value ([Note: no host sync in a step])
        dev = ps.device
        self._interval = torch.zeros(self.num_layers, self.experts + 4, dtype=torch.float64,
                                     device=dev)
        self._min = torch.full((self.num_layers,), float("inf"), dtype=torch.float64,
                               device=dev)
        self._max = torch.zeros(self.num_layers, dtype=torch.float64, device=dev)

    def step(self) -> None:
        """After an optimizer step: the step's counts summed over DP, the expert biases
        moved, the interval's sums grown (module doc)."""
        if not self.layers:
            return
        step = torch.stack([layer.stats.take_row(self.ps.device)
                            for layer in self.layers.values()])
        self.ps.dp_cp_group.all_reduce(step)
        # under TP each rank routed its own tokens (sequence parallelism): theirs too.
        # A micro-batch's losses, the same on each rank of its split, are summed as
        # often as its micro-batches are counted, so their means stay its own
        self.ps.tp_group.all_reduce(step)
        ids = torch.tensor(list(self.layers), device=self.ps.device)
        counts = step[:, : self.experts]
        for layer in self.layers.values():  # global_aux_loss's running counts: per step
            if layer.global_counts is not None:
                layer.global_counts.reset()
        if self.moe.moe_router_enable_expert_bias:
            for row, layer in zip(counts, self.layers.values()):
                router = layer.experts.router
                router.update_expert_bias(row, self.moe.moe_router_bias_update_rate)
        self._interval[ids] += step
        self._min[ids] = torch.minimum(self._min[ids], counts.min(dim=1).values)
        self._max[ids] = torch.maximum(self._max[ids], counts.max(dim=1).values)
        self.steps += 1

    def line(self) -> dict[str, dict[str, float]]:
        """Per MoE layer (``"layer_<i>"``) of the whole model, the interval's numbers
        (module doc), equal on every rank; then the interval starts again. Empty for a
        dense model."""
        if self.moe.num_experts is None:
            return {}
        # each layer lives on one stage: a sum over the stages, zeros elsewhere (a stage's
        # layers without a step yet, inf fewest, too)
        fewest = torch.where(torch.isinf(self._min), 0.0, self._min)
        sums = torch.cat([self._interval, fewest[:, None], self._max[:, None]], dim=1)
        sums = sums.to(self.ps.device)
        self.ps.pp_group.all_reduce(sums)
        sums = sums.cpu()
        out = {}
        steps = max(self.steps, 1)
        for i in range(self.num_layers):
            micro = float(sums[i, self.experts + 3])
            if micro == 0:
                continue  # a dense layer (or no step yet)
            out[f"layer_{i}"] = {
                "aux_loss": float(sums[i, self.experts + 1]) / micro,
                "z_loss": float(sums[i, self.experts + 2]) / micro,
                "tokens_per_expert_min": float(sums[i, -2]),
                "tokens_per_expert_max": float(sums[i, -1]),
                "dropped_per_step": float(sums[i, self.experts]) / steps,
            }
        self._interval.zero_()
        self._min.fill_(float("inf"))
        self._max.zero_()
        self.steps = 0
        return out

    def buffers(self) -> dict[str, list[float]]:
        """The expert biases of every stage's MoE layers (collective over the pipeline
        group), by name (``blocks.<i>.mlp.experts.router.expert_bias``); empty without
        ``--moe-router-enable-expert-bias``."""
        if not self.moe.moe_router_enable_expert_bias:
            return {}
        mine = {f"blocks.{i}.mlp.experts.router.expert_bias":
                layer.experts.router.expert_bias.tolist() for i, layer in self.layers.items()}
        out: dict[str, list[float]] = {}
        for stage in gather_json(self.ps.pp_group, mine, self.ps.device):
            out.update(stage)
        return out

    def load_buffers(self, saved: dict | None, checkpoint: str) -> None:
        """Put ``saved`` (a checkpoint's ``"buffers"``) into this stage's layers; a
        CheckpointError naming ``checkpoint`` when the run keeps an expert bias and the
        checkpoint has none for one of its layers."""
        if not self.moe.moe_router_enable_expert_bias:
            return
        for i, layer in self.layers.items():
            name = f"blocks.{i}.mlp.experts.router.expert_bias"
            if saved is None or name not in saved:
                raise CheckpointError(
                    f"{checkpoint}: no {name} (the run saved no expert bias): load it "
                    f"without --moe-router-enable-expert-bias, or start from --seed")
            bias = layer.experts.router.expert_bias
            bias.copy_(torch.tensor(saved[name], dtype=bias.dtype))
