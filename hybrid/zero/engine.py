"""apply_zero: ZeRO-DP applied to a model from outside.

    engine = apply_zero(model, ps, cfg.zero, adamw=cfg.adamw, precision=cfg.precision,
                        offload=cfg.offload, values=InitValues(seed, model.init_of))
    for tokens, labels in micro_batches:
        engine.backward(model(tokens, labels) / n, sync=is_last)
    result = engine.step(lr)

What each stage keeps on a rank (Psi = this TP rank's parameters, N = DP size;
the stage is resolved once into a :class:`ShardingPlan`):

=======  ==============  =================  =======================================
stage    parameters      gradients          fp32 master + Adam moments
=======  ==============  =================  =======================================
0        all             all (all-reduce)   all
1        all             all (reduce-scat.) 1/N
2        all             1/N                1/N
3        1/N             1/N                1/N
=======  ==============  =================  =======================================

Frozen parameters (``requires_grad`` False) have no gradient nor optimizer state; at
stage 3 they are partitioned too, 1/N each, in frozen units the gatherer gathers and
nothing else sees (``frozen_units``; [Note: frozen units] in hybrid/zero/units.py),
and with parameter offload their shards live off the device in parameter homes, as the
trainable units' do ([Note: frozen units at home] in hybrid/zero/offload/tiers.py).

All parameters live as views of flat buffers (one for the whole units, one per
module at stage 3), gradients too at stages 0-1 -- no per-parameter allocation
in a step. Gradients are accumulated and reduced in ``precision.grads_dtype`` (fp32
with ``--accumulate-allreduce-grads-in-fp32``, the default under bf16).
The model may be built on the meta device: the engine materializes only what
this rank keeps (see :mod:`hybrid.zero.units`).
[Note: ZeRO over DP x CP] CP ranks hold the same parameters, each with its tokens' part of
their gradients: shard and reduce over ``ps.dp_cp_group`` (the DP group at CP 1),
dividing by the DP size only -- a sum over CP, a mean over DP
(docs/context-parallelism.md).

[Note: tied copies across pipeline stages]
With tied embeddings under pipeline parallelism the first stage embeds with
``wte.weight`` and the last stage's head reads its own copy of it (``tied``
names such parameters). The copies start equal (the init by name) and stay
equal: each gets a ZeRO unit of its own, of the same size and DP partition on
both stages (:mod:`hybrid.zero.units`), and at the step, once DP has reduced
it, its gradient shard is summed over ``ps.embedding_group`` (the two stages'
ranks at the same TP, CP and DP position) -- both then step the same master
from the same gradient. The norm counts it on the first stage only. Where the
embedding group is one rank (PP 1, a middle stage) nothing is tied and the
units are an untied run's. With the optimizer offloaded, every other unit's
gradient goes down to the host as its last reduction ends; the tied unit's
waits for the step, which sums it first (the sinks' ``sum_tied``;
[Note: a tied unit waits for the step] in hybrid/zero/offload/landing.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from hybrid.config.sections import AdamWConfig, OffloadConfig, PrecisionConfig, ZeroConfig
from hybrid.errors import ConfigError
from hybrid.kernels.dtypes import DTYPES
from hybrid.parallel.state import ParallelState
from hybrid.recompute.phase import RecomputePhase
from hybrid.tensor_parallel import is_tp_split
from hybrid.zero.buffers import allocate_grads, allocate_master
from hybrid.zero.client_optimizer import ClientShardOptimizer
from hybrid.zero.gather_pipeline import GatherPipelines, ShardPublisher
from hybrid.zero.grad_sync import DeviceShard, GradReducer, GradSink
from hybrid.zero.loss_scaler import LossScaler, scaled_loss
from hybrid.zero.offload.contracts import ShardOptimizer
from hybrid.zero.offload.host_step import OptimizerOffload
from hybrid.zero.offload.landing import CopyDown, GradLanding
from hybrid.zero.offload.nvme.adamw import SwappedAdamW
from hybrid.zero.offload.tiers import OffloadTiers
from hybrid.zero.optimizer import ShardedAdamW, global_grad_norm, squared_norm
from hybrid.zero.param_sync import ParamGatherer
from hybrid.zero.parts import split_by_part
from hybrid.zero.plan import ShardingPlan
from hybrid.zero.units import (
    Materializer,
    OwnedPiece,
    ValueSource,
    is_expert,
    owned_pieces,
    plan_frozen_units,
    plan_units,
)

log = logging.getLogger("hybrid")


@dataclass
class StepResult:
    """What one :meth:`ZeroEngine.step` did.

    ``grad_norm``: the global gradient norm (unscaled), a 0-dim fp64 tensor on the
    device -- read it when logging, not every step. ``skipped``: a 0-dim bool tensor on
    the device, the same on every rank: the step changed nothing (a non-finite gradient
    norm or loss). ``loss_scale``: the scale the next step uses. ``host_skipped``:
    ``skipped`` as a Python bool when the engine has already read it (dynamic fp16 loss
    scaling must, to adjust its scale), else None: read ``skipped`` where the host waits
    for the device anyway (see hybrid/train/step_stats.py).
    """

    grad_norm: torch.Tensor
    skipped: torch.Tensor
    loss_scale: float
    host_skipped: bool | None = None


class ZeroEngine:
    """See the module docstring; built by :func:`apply_zero`."""

    def __init__(self, model: nn.Module, ps: ParallelState, zero: ZeroConfig, *,
                 adamw: AdamWConfig, precision: PrecisionConfig, offload: OffloadConfig,
                 values: ValueSource | None = None, parts: list[list[nn.Parameter]] | None = None,
                 unit_modules: Iterable[nn.Module] | None = None, tied: Collection[str] = (),
                 recompute: RecomputePhase | None = None,
                 client: torch.optim.Optimizer | None = None, decay: str = "matrices"):
        self.model, self.ps = model, ps
        self.plan = ShardingPlan.for_stage(zero.stage)  # the stage, resolved once: plan.stage
        self.clip_grad, self._norm_counts_replicated = adamw.clip_grad, (
            adamw.clip_norm_of == "model" or ps.pp_rank == 0)  # (AdamWConfig.clip_norm_of)
        self.dtype = DTYPES[precision.params_dtype]
        self.grad_dtype = DTYPES[precision.grads_dtype]
        self.scaler = LossScaler.from_config(precision)
        tied = _tied_names(model, ps, tied)
        self.units, owners = plan_units(model, ps, zero, self.plan, unit_modules, alone=tied)
        # [Note: tied copies across pipeline stages]
        ids = {id(p) for n, p in model.named_parameters() if n in tied}
        self.tied_units = [u for u in self.units if len(u.params) == 1 and id(u.params[0]) in ids]
        # a model in parts: no unit across two (hybrid/zero/parts.py); the part of each unit
        self.unit_parts = [0] * len(self.units)
        if parts is not None:
            self.units, owners, self.unit_parts = split_by_part(self.units, owners, parts)
        # [Note: frozen units] (hybrid/zero/units.py): stage 3 partitions the frozen
        # parameters too, in units the gatherer gathers and nothing else sees
        frozen = plan_frozen_units(model, ps, zero, self.plan, unit_modules) if parts is None \
            else []
        self.frozen_units = [u for _, u in frozen]
        self._pieces = owned_pieces(model, self.units)  # the layout is fixed from here on
        # [Note: the order of construction] Each part is built from the parts above it.
        self.tiers = OffloadTiers(offload, ps.rank, self.units, dtype=self.dtype,
                                  grad_dtype=self.grad_dtype, device=ps.device,
                                  frozen=self.frozen_units)
        master = self._materialize(Materializer(model, values, self.units + self.frozen_units),
                                   offload)
        lands = self._gradients_land(offload)
        self.flat_grads = allocate_grads(self.units, sharded=self.plan.grads, dtype=self.dtype,
                                         grad_dtype=self.grad_dtype, device=ps.device,
                                         lands=lands)
        # every parameter all-gather (stage 3's per-module ones, stages 1-2's after the
        # step) goes through one pipeline: two staging buffers of at most a bucket
        self.param_pipeline = GatherPipelines(zero.allgather_bucket_size, ps.device)
        self.publisher = ShardPublisher(self.param_pipeline, sharded=self.plan.optimizer)
        # (a root unit runs in every part's forward: its part says nothing of what follows)
        where = {id(u): k for u, k in zip(self.units, self.unit_parts)}
        self.gatherer = (ParamGatherer(owners + frozen, self.param_pipeline,
                                       recompute or RecomputePhase(),
                                       parts={id(u): None if m is model else where[id(u)]
                                              for m, u in owners} if parts is not None else None,
                                       home=where if parts is not None else None,
                                       frozen=self.frozen_units)
                         if owners or frozen else None)
        self.optimizer = self._build_optimizer(master, adamw, offload, client, decay)
        self.offload = self._build_offload(offload)
        self.sink = self._pick_sink(lands)
        self.reducer = GradReducer(self.units, self.plan, dp=ps.dp_cp_group, sink=self.sink,
                                   bucket=zero.reduce_bucket_size, overlap=zero.overlap_comm,
                                   grad_dtype=self.grad_dtype, replicas=ps.dp_size,
                                   parts=self.unit_parts, names=model.named_parameters(),
                                   release=self.gatherer.after_grads if self.gatherer else None,
                                   ignore_unused=zero.ignore_unused_parameters)
        # With a separate master the step writes each unit's new parameter shard in
        # the training dtype (a compiled kernel in the same pass as the update):
        # that is the publication, no master -> shard copy after it.
        self._step_out = [u.shard for u in self.units] if self.separate_master else None
        # inf/NaN gradients the kernels met and the norm did not show, read at poll_warnings()
        self._kernel_found = torch.zeros(1, dtype=torch.float32, device=ps.device)
        self._closed = False  # close() ran

    # [Note: the order of construction]
    # Every part takes what it uses as constructor arguments and nothing is attached to
    # it afterwards, so the order above is the data's: the tiers (the swap files, checked
    # and allocated before any memory is committed), the model's storage, the gradient
    # buffer, the gathers, the optimizer, the host step that steps it, the sink that
    # feeds the host step, the reducer that feeds the sink. One order is not a data
    # dependency: the fp32 master must be read before the parameters are bound to
    # their flat buffers (_materialize), because a parameter that becomes a
    # low-precision view has lost its exact fp32 value.

    # -- construction ------------------------------------------------------------
    def _materialize(self, fill: Materializer, offload: OffloadConfig) -> list[torch.Tensor]:
        """The fp32 master (see [Note: the order of construction]), then every unit's
        parameter storage; returns the master per unit (the fp32 shards themselves when
        there is no separate master)."""
        ps = self.ps
        self.separate_master = self.dtype != torch.float32 or offload.optimizer is not None
        self.flat_master, master, self.swapped = allocate_master(
            self.units, self._pieces, fill, offload=offload, tiers=self.tiers,
            device=ps.device if self.separate_master else None)
        whole = [u for u in self.units if not u.partition_params]
        self.flat_params = torch.empty(sum(u.padded for u in whole), dtype=self.dtype,
                                       device=ps.device)
        # (stage 3 with --offload-param: each shard goes home as soon as it is made)
        fill.bind(self.units, self.flat_params, dtype=self.dtype, device=ps.device,
                  bound=self.tiers.send_home)
        # (a frozen unit's shard goes home too, though no step writes it back: [Note:
        # frozen units at home] in hybrid/zero/offload/tiers.py)
        fill.bind(self.frozen_units, self.flat_params, dtype=self.dtype, device=ps.device,
                  bound=self.tiers.send_home)
        return master if master is not None else [u.shard for u in self.units]

    def _gradients_land(self, offload: OffloadConfig) -> bool:
        """An offloaded optimizer at stages 2-3 reads host copies of the gradient shards
        (or, on the nvme tier, swapped ones); the device keeps none (offload/landing.py)
        -- unless, on a CPU, the flat shard is that host buffer itself (host tier, no
        delayed update reading it while the next step writes)."""
        return bool(offload.optimizer) and self.plan.grads and (
            self.ps.device.type != "cpu" or offload.delayed_update
            or offload.optimizer == "nvme")

    def _build_optimizer(self, master: list[torch.Tensor], adamw: AdamWConfig,
                         offload: OffloadConfig, client: torch.optim.Optimizer | None,
                         decay_rule: str) -> ShardOptimizer:
        # per unit part: the ranges with weight decay (matrices, or all), the TP-split ones
        decay: list[list[tuple[int, int]]] = [[] for _ in self.units]
        split: list[list[tuple[int, int]]] = [[] for _ in self.units]
        for pc in self._pieces:
            rng = (pc.part.start, pc.part.stop)
            if decay_rule == "all" or pc.param.ndim >= 2:
                decay[pc.unit].append(rng)
            if is_tp_split(pc.param) or is_expert(pc.param):  # (summed over a group)
                split[pc.unit].append(rng)
        # the last stage's copy of a tied embedding: the first stage counts it
        excluded = ([k for k, u in enumerate(self.units) if u in self.tied_units]
                    if not self.ps.is_first_stage else [])
        # [Note: expert units] unsharded, each rank's experts are its own: their squares
        # are summed over ETP x EP, the TP shards' over TP (the groups overlap when EP
        # folds over TP), so the experts' are taken apart (step) and the optimizer's norm
        # leaves them out
        self._expert_norm_units = (
            [k for k, u in enumerate(self.units) if any(is_expert(p) for p in u.params)]
            if not self.plan.optimizer and self.ps.experts_split else [])
        excluded += self._expert_norm_units
        if client is not None:
            if self.swapped is not None:
                raise ConfigError(
                    f"a client optimizer ({type(client).__name__}) with the optimizer on "
                    f"NVMe: hybrid's NVMe tier swaps its own AdamW's states; offload the "
                    f"optimizer to \"cpu\", or use the ds_config's \"optimizer\" block")
            return ClientShardOptimizer(client, self._pieces, master, split,
                                        flat_master=self.flat_master, excluded=excluded)
        if self.swapped is not None:
            return SwappedAdamW([u.own_hi - u.own_lo for u in self.units], decay, split, adamw,
                                states=self.swapped, excluded=excluded)
        # At stages 2-3 the gradient shard is one flat buffer in master order: the
        # kernels may then update the whole shard in one pass (the offload keeps
        # host copies of its own and steps through step_parts).
        flat_grad = self.flat_grads if self.plan.grads and not offload.optimizer else None
        return ShardedAdamW(master, decay, split, adamw, flat_master=self.flat_master,
                            flat_grad=flat_grad, excluded=excluded)

    def _build_offload(self, offload: OffloadConfig) -> OptimizerOffload | None:
        """The host step of ``--offload-optimizer`` (None without it): it reads the
        gradients from the tiers' store, writes new shards to their homes and tells the
        publisher."""
        if not offload.optimizer:
            return None
        tiers = self.tiers
        return OptimizerOffload(self.units, self.optimizer, offload, plan=self.plan,
                                dtype=self.dtype, grad_dtype=self.grad_dtype,
                                device=self.ps.device, flat_grads=self.flat_grads,
                                homes=tiers.homes(self.units), publisher=self.publisher,
                                swapped_grads=tiers.grads, pin=tiers.pin,
                                speculation_of=tiers.speculation_of(self.optimizer, self.dtype))

    def _pick_sink(self, lands: bool) -> GradSink:
        """Where the reducer puts reduced shards, chosen once ([Note: one gradient sink]):
        the device shard the device optimizer reads; else the host step's store,
        through the device's own flat shard or, when ``lands``, through two landing
        buffers (the store is host memory or grads.swp: the tiers decided)."""
        if lands:
            assert self.offload is not None  # (only an offloaded optimizer's gradients land)
            return GradLanding(self.units, self.offload, self.optimizer, dtype=self.grad_dtype,
                               device=self.ps.device, tied=self.tied_units)
        assert self.flat_grads is not None  # (allocated unless the gradients land)
        if self.offload is None:
            return DeviceShard(self.units, self.flat_grads)
        return CopyDown(self.units, self.offload, self.flat_grads, tied=self.tied_units)

    def owned_pieces(self) -> tuple[OwnedPiece, ...]:
        """Every parameter piece this rank owns for the optimizer (its 1/N of each unit;
        all of them at stage 0), unit by unit in the order of its flat shard. A piece
        names the parameter, its TP-local element range ``[lo, hi)``, and where its
        values lie (:class:`~hybrid.zero.units.OwnedPiece`). Fixed at construction;
        what checkpoints, diagnostics and tests read the shard through."""
        return self._pieces

    # -- the step ------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.sink.reset()

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """Backward of ``loss`` (scaled for fp16); reductions run from hooks.

        ``sync=False`` for all but the last micro-batch of a step: stages 0-1
        then only accumulate locally. The scaling is in fp32 (:func:`scaled_loss`).
        """
        self.begin_backward(sync)
        scaled_loss(loss, self.scaler.scale).backward()
        self.end_backward()

    def begin_backward(self, sync: bool, part: int | None = None) -> None:
        """Before a backward run by the caller (any time after the last one ended):
        ``sync`` as in :meth:`backward`. The hooks reduce as gradients arrive.
        ``part``: the backward reaches only that part of the model (``parts`` given to
        :func:`apply_zero`: an interleaved pipeline rank's chunk), and ``sync`` marks
        that part's last backward of the step (:mod:`hybrid.zero.parts`); None: the
        whole model."""
        self.reducer.begin(sync, part)
        if self.gatherer is not None:
            self.gatherer.backward_part = part

    def end_backward(self) -> None:
        """After a backward begun by :meth:`begin_backward` has returned: the deferred
        units' reductions and those left unfilled (grad_sync.py, [Note: unused parameters]),
        every reduction waited for, stage 3's gathers freed."""
        self.reducer.finish()
        if self.gatherer is not None:
            self.gatherer.backward_part = None
            if not self.gatherer.hold:
                self.gatherer.release_all()

    @contextlib.contextmanager
    def params_held(self, on: bool = True) -> Iterator[None]:
        """Inside the block (with ``on``) stage 3 keeps each unit it gathers whole --
        after a forward, after its gradients are packed, after :meth:`end_backward` --
        until :meth:`release_params` frees its part; every unit is freed on leaving. A
        pipeline step runs in one, so each unit is gathered once a step, not once per
        micro-batch in forward and again in backward (hybrid/zero/param_sync.py, [Note:
        held for a pipeline step]). Other stages, and ``on=False``: nothing changes."""
        g = self.gatherer
        if g is None or not on:
            yield
            return
        g.hold = True
        try:
            yield
        finally:
            g.hold = False
        g.release_all()  # (not while an exception propagates: a gather may never match)

    def release_params(self, part: int | None = None) -> None:
        """Free stage 3's gathered units of ``part`` (:mod:`hybrid.zero.parts`; None:
        every unit), e.g. after that part's last backward of a step in
        :meth:`params_held`; a unit it frees is gathered again at its next use."""
        if self.gatherer is None:
            return
        # (frozen units exist only for a model in one part, part 0: [Note: frozen units])
        self.gatherer.release(self.gatherer.units if part is None else
                              [u for u, k in zip(self.units, self.unit_parts) if k == part]
                              + (self.frozen_units if part == 0 else []))

    def prefetch_step(self, lr: float | None = None, grad_divisor: float = 1.0) -> None:
        """This rank's backwards of the step have ended: start what the coming
        :meth:`step` can do before its norm is known -- the nvme tier's first tiles off
        the disk and, given the step's ``lr`` and ``grad_divisor`` (those :meth:`step` will
        be called with), their speculative update on the host step's worker
        ([Note: what starts before the step] in hybrid/zero/offload/host_step.py;
        nothing without an offloaded optimizer). Changes no number."""
        if self.offload is not None:
            self.offload.prefetch(lr, None if lr is None else self.scaler.scale * grad_divisor)

    def offload_read_ahead(self) -> int:
        """Chunks of the offloaded optimizer's states read ahead of their step by
        :meth:`prefetch_step`, summed over the steps so far (0: none, or no offload)."""
        return 0 if self.offload is None else self.offload.read_ahead

    def offload_speculation(self) -> dict:
        """Tiles of the speculative update, summed over the steps so far: ``speculated``,
        then ``used`` or ``discarded`` by the step ({} where none is made: see
        :meth:`OptimizerOffload.speculation`)."""
        return {} if self.offload is None else self.offload.speculation()

    # [Note: one skip decision, no extra all-reduce]
    # global_grad_norm sums squared norms over DP (disjoint shards, or nothing at stage 0
    # where the all-reduced gradients are the same on every replica), over TP and over PP,
    # and every rank of an all-reduce receives the same bits. They cover the world, so
    # every rank holds the same norm, and an inf/NaN in any rank's gradient (squares cannot
    # cancel it; one left out of a DeepSpeed pipeline norm raises the flag) makes it
    # non-finite everywhere. A world all-reduce of an overflow flag would agree with it
    # always, so there is none for the gradients. A rank's loss is its own,
    # though: when the loop passes it, a "non-finite loss" flag rides in the norm's own
    # vector (on the device, no host read; a one-element DP all-reduce at stage 0), so an
    # infinite loss with finite gradients skips the step everywhere at no collective of
    # its own. The decision stays on the device (kernels skip on a flag) unless dynamic
    # loss scaling has to adjust its scale: that read is the one host sync of an fp16
    # step, and a bf16/fp32 step has none.
    def step(self, lr: float, loss: torch.Tensor | None = None,
             grad_divisor: float = 1.0) -> StepResult:
        """Unscale, decide skip (same on all ranks), clip, update, re-assemble params.

        ``loss``: this rank's loss of the step; a non-finite one skips the step
        like a non-finite gradient does, even when the gradients are finite.
        ``grad_divisor``: what the accumulated gradient is divided by besides the loss
        scale (the micro-batch count, when each backward was of an undivided loss).
        """
        if self.tied_units:  # [Note: tied copies across pipeline stages]
            self.sink.sum_tied(self.tied_units, self.ps.embedding_group)
        # (on the device where the norm or the update reads them: landed ones are not read)
        grads = cast(list[torch.Tensor], [u.grad_shard for u in self.units])
        dp = self.ps.dp_cp_group if self.plan.optimizer else None
        # the "split" terms are summed over TP; at stage 0 the experts' apart, over ETP x
        # EP ([Note: expert units])
        experts = None
        if self._expert_norm_units:
            experts = (torch.stack([squared_norm(grads[k]) for k in self._expert_norm_units])
                       .sum(), (self.ps.ep_group, self.ps.etp_group))
        scale = self.scaler.scale * grad_divisor  # what the gradient is a multiple of
        # (landed gradients are on the host by now: their norm terms were taken on landing)
        squared = self.sink.squared_norms()
        norm, bad_loss = global_grad_norm(
            self.optimizer, None if squared is not None else grads, self.ps.tp_group, dp, loss,
            self.ps.dp_cp_group, squared, self.ps.pp_group if self.ps.pp_size > 1 else None,
            count_replicated=self._norm_counts_replicated, experts=experts)
        norm = norm / scale
        decided = ~torch.isfinite(norm) | bad_loss
        skip: torch.Tensor | None = decided
        host_skipped = None
        if self.scaler.dynamic:
            host_skipped = bool(skip)  # the host sync of an fp16 step
            self.scaler.update(host_skipped)
            if host_skipped:
                if self.offload is not None:
                    self.offload.discard_step()
                return StepResult(norm, decided, self.scaler.scale, host_skipped)
            skip = None  # known clean: the kernels need no flag
        coef = self._grad_coefficient(norm) / scale
        if self.offload is not None:  # (it keeps its own non-finite flag)
            self.offload.step(lr, coef, skip)
            # it started each unit's all-gather as the unit's parameters came up
            self.publisher.wait()
        else:  # (no offload: on the device)
            assert isinstance(self.optimizer, (ShardedAdamW, ClientShardOptimizer))
            self.optimizer.step(grads, lr, coef, skip, out=self._step_out,
                                found_inf=self._kernel_found)
            self.publish_params(after_step=True)
        return StepResult(norm, decided, self.scaler.scale, host_skipped)

    def _grad_coefficient(self, norm: torch.Tensor) -> torch.Tensor:
        """``min(1, clip / (norm + 1e-6))`` (torch's clip_grad_norm_), computed on the
        device: no branch on the norm's value."""
        if self.clip_grad <= 0:
            return torch.ones_like(norm)
        return torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)

    def poll_warnings(self) -> None:
        """Host-side checks deferred to a point that syncs anyway (a log line): warn
        if a kernel met a non-finite gradient that the norm did not show."""
        found = self._kernel_found if self.offload is None else self.offload.found
        if bool(found.item()):
            # the norm was finite on every rank, so this means memory changed under us
            log.warning("optimizer step met a non-finite gradient the norm did not show")
            found.zero_()

    def wait_optimizer(self) -> None:
        """Finish an optimizer update still running on the host (ZeRO-Offload's delayed
        update), so the master weights and moments are this step's: before saving
        or loading them."""
        if self.offload is not None:
            self.offload.wait()

    @torch.no_grad()
    def publish_params(self, after_step: bool = False) -> None:
        """Master -> this rank's parameter shard -> (stages 1-2) all-gather.

        ``after_step``: called right after an optimizer step, which already wrote
        the shards (its ``out``); otherwise the master is the source (e.g. a
        checkpoint was just loaded into it).
        """
        if self.offload is not None:
            self.offload.upload_master()
        elif self.separate_master and not after_step:
            master = self.optimizer.master
            assert master is not None  # (no offload: the master is in device memory)
            for u, m in zip(self.units, master):
                u.shard.copy_(m)
        if not self.plan.optimizer:
            return
        for u in self.units:
            self.publisher.publish(u)
        self.publisher.wait()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter holds its full (TP-local) value inside the block.

        Stage 3 all-gathers the partitioned units and frees them on exit; other
        stages hold full parameters anyway. For reading weights (checkpoints,
        export, tests), not for running the model.
        """
        if self.gatherer is None:
            yield
            return
        for u in self.gatherer.units:
            u.finish_gather(self.param_pipeline)
        try:
            yield
        finally:
            self.gatherer.release_all()

    # -- accounting ----------------------------------------------------------------
    def model_state_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer states held by this rank now,
        read from the storages actually allocated."""
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()
        params = nbytes(self.flat_params) + sum(
            u.shard.untyped_storage().nbytes() + u.full.untyped_storage().nbytes()
            for u in self.units + self.frozen_units if u.partition_params
        ) + self.tiers.param_device_bytes()
        opt = self.optimizer.state_bytes() + nbytes(self.flat_master)
        if self.offload is not None:
            opt += self.offload.nbytes()
        # Offloaded, the optimizer's bytes are host memory, not accelerator memory.
        host = opt if self.offload is not None else 0
        host += self.tiers.param_host_bytes()
        disk = self.tiers.disk_bytes()
        grads = self.sink.device_bytes()
        return {"params": params, "grads": grads, "optimizer": opt,
                "total": params + grads + opt, "host": host, "disk": disk}

    def grad_values(self, pc: OwnedPiece) -> torch.Tensor:
        """This rank's reduced gradient of owned piece ``pc`` as the step reads it: its
        gradient shard, or the host buffer it went down to (for reading, e.g. why a
        skipped step was not finite)."""
        return self.sink.values(pc.unit)[pc.part]

    def offload_seconds(self) -> dict:
        """:meth:`OptimizerOffload.seconds` (with the swap I/O's waits), or {}."""
        return {} if self.offload is None else self.offload.seconds(self.tiers.io)

    def in_flight(self) -> int:
        """Collectives this engine launched and has not waited for: gradient reductions
        and parameter gathers. None once a backward or a step has returned; a stage-3
        prefetch stays in flight after the forward of a part of the model (the unit
        after it), and a call that raised may leave any."""
        return self.reducer.in_flight() + self.param_pipeline.in_flight()

    def close(self) -> None:
        """Finish what is in flight -- the host update, and the collectives of
        :meth:`in_flight` (every rank closes: they are waited for) -- then delete the
        swap files (scratch; a restart rebuilds them from its checkpoint). Called while
        an exception propagates (a ``finally`` block), the collectives are left
        instead: a peer may never match them, and the rank would wait for it until the
        collective timeout. The engine cannot step afterwards; a second close does
        nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_optimizer()
            if sys.exc_info()[1] is None:
                self.reducer.drain()
                if self.gatherer is not None:
                    self.gatherer.release_all()  # (finishes a prefetch, then frees)
                self.param_pipeline.wait_all()
        finally:
            self.tiers.close()

    def comm_temp_bytes(self) -> dict:
        """Bytes of the reusable communication staging buffers: the gradient reducer's
        and the parameter gathers' (each at most two buckets)."""
        return {"reduce": self.reducer.temp_bytes(), "gather": self.param_pipeline.temp_bytes()}


def _tied_names(model: nn.Module, ps: ParallelState, tied: Collection[str]) -> tuple[str, ...]:
    """The names of ``tied`` the engine sums over ``ps.embedding_group``: none where that
    group is this rank alone; a ValueError when one is not in ``model`` (the other rank
    would wait for it)."""
    group = ps.embedding_group
    if group.size == 1 or not tied:
        return ()
    names = {n for n, _ in model.named_parameters()}
    missing = [n for n in tied if n not in names]
    if missing:
        raise ValueError(f"tied parameter {missing[0]!r} is not in this rank's model, but "
                         f"its embedding group (global ranks {group.ranks}) holds "
                         f"{group.size} copies: every rank of the group must hold one")
    return tuple(tied)
