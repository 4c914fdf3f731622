"""apply_zero: ZeRO-DP applied to a model from outside.

    engine = apply_zero(model, ps, cfg.zero, values=InitValues(seed, model.init_of))
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

All parameters live as views of flat buffers (one for the whole units, one per
module at stage 3), gradients too at stages 0-1 -- no per-parameter allocation
in a step. Gradients are accumulated and reduced in ``cfg.grads_dtype`` (fp32
with ``--accumulate-allreduce-grads-in-fp32``, the default under bf16).
The model may be built on the meta device: the engine materializes only what
this rank keeps (see :mod:`hybrid.zero.units`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from hybrid.config_sections import ZeroConfig
from hybrid.kernels.adam import has_adam_kernel
from hybrid.parallel_state import ParallelState
from hybrid.phase import RecomputePhase
from hybrid.tensor_parallel import is_tp_split
from hybrid.zero.flat_unit import gather_pieces
from hybrid.zero.grad_sync import GradReducer
from hybrid.zero.loss_scaler import LossScaler
from hybrid.zero.offload import OptimizerOffload
from hybrid.zero.optimizer import ShardedAdamW, global_grad_norm
from hybrid.zero.param_sync import ParamGatherer
from hybrid.zero.plan import ShardingPlan
from hybrid.zero.units import Materializer, plan_units

log = logging.getLogger("hybrid")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float


class ZeroEngine:
    """See the module docstring; built by :func:`apply_zero`."""

    def __init__(self, model: nn.Module, ps: ParallelState, cfg: ZeroConfig, values=None,
                 unit_modules=None, recompute: RecomputePhase | None = None):
        self.model, self.ps, self.cfg = model, ps, cfg
        self.plan = ShardingPlan.for_stage(cfg.stage)
        self.stage = cfg.stage
        self.dtype, self.grad_dtype = DTYPES[cfg.params_dtype], DTYPES[cfg.grads_dtype]
        self.scaler = LossScaler.from_config(cfg)
        self.units, owners = plan_units(model, ps, cfg, self.plan, unit_modules)
        fill = Materializer(model, values)
        # fp32 master weights first: they read the exact fp32 values, which a
        # materialized model loses once its parameters become low-precision views.
        master = self._allocate_master(fill)
        whole = [u for u in self.units if not u.partition_params]
        self.flat_params = torch.empty(sum(u.padded for u in whole), dtype=self.dtype,
                                       device=ps.device)
        fill.bind(self.units, self.flat_params, self.dtype, ps.device)
        self._allocate_grads()
        self.gatherer = (ParamGatherer(owners, cfg.allgather_bucket_size,
                                       recompute or RecomputePhase()) if owners else None)
        self.reducer = GradReducer(self.units, self.plan, ps.dp_group, cfg.reduce_bucket_size,
                                   cfg.overlap_comm, self.grad_dtype,
                                   self.gatherer.after_reduce if self.gatherer else None)
        self._build_optimizer(master if master is not None else [u.shard for u in self.units])

    # -- construction ------------------------------------------------------------
    def _allocate_master(self, fill: Materializer) -> list[torch.Tensor] | None:
        """One flat fp32 buffer over this rank's owned ranges (on the host when
        offloaded); None when the fp32, on-device parameter shards are their own master."""
        self.separate_master = self.dtype != torch.float32 or self.cfg.offload_optimizer
        self.flat_master = None
        if not self.separate_master:
            return None
        dev = torch.device("cpu") if self.cfg.offload_optimizer else self.ps.device
        n = sum(u.own_hi - u.own_lo for u in self.units)
        pin = self.cfg.offload_optimizer and torch.cuda.is_available()
        self.flat_master = torch.empty(n, dtype=torch.float32, device=dev, pin_memory=pin)
        master, off = [], 0
        for u in self.units:
            part = self.flat_master[off: off + u.own_hi - u.own_lo]
            fill.fill_master(u, part)
            master.append(part)
            off += part.numel()
        return master

    def _allocate_grads(self) -> None:
        """Full gradients (plan.grads False: ``unit.grad_full`` views, ``param.grad``
        views too when they share the dtype) or this rank's shard only."""
        dev, dt = self.ps.device, self.grad_dtype
        if not self.plan.grads:
            self.flat_grads = torch.zeros(sum(u.padded for u in self.units), dtype=dt, device=dev)
            off = 0
            for u in self.units:
                u.grad_full = self.flat_grads[off: off + u.padded]
                u.grad_shard = u.grad_full[u.own_lo: u.own_hi]
                if dt == self.dtype:  # autograd accumulates straight into the buffer
                    for p, o in zip(u.params, u.offsets):
                        p.grad = u.grad_full[o: o + p.numel()].view_as(p)
                off += u.padded
            return
        self.flat_grads = torch.zeros(sum(u.own_hi - u.own_lo for u in self.units),
                                      dtype=dt, device=dev)
        off = 0
        for u in self.units:
            n = u.own_hi - u.own_lo
            u.grad_shard = self.flat_grads[off: off + n]
            off += n

    def _build_optimizer(self, master: list[torch.Tensor]) -> None:
        cfg = self.cfg
        decay, split = [], []
        for u in self.units:
            d, s = [], []
            for i, plo, ulo, n in u.segments(u.own_lo, u.own_hi):
                rng = (ulo - u.own_lo, ulo - u.own_lo + n)
                (d if u.params[i].ndim >= 2 else []).append(rng)
                (s if is_tp_split(u.params[i]) else []).append(rng)
            decay.append(d)
            split.append(s)
        self.optimizer = ShardedAdamW(master, decay, split, (cfg.adam_beta1, cfg.adam_beta2),
                                      cfg.adam_eps, cfg.weight_decay, self.flat_master)
        self.offload = (OptimizerOffload(self.units, self.dtype, self.flat_grads, self.plan)
                        if cfg.offload_optimizer else None)
        # One fused pass over the flat shard where the gradient shard is already
        # flat and in master order (stages 2-3) and a compiled kernel exists;
        # otherwise torch's fused AdamW per unit.
        self._flat_step = (self.offload is None and self.separate_master and self.plan.grads
                           and has_adam_kernel(self.flat_master.device))

    # -- the step ------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    def backward(self, loss: torch.Tensor, sync: bool = True) -> None:
        """Backward of ``loss`` (scaled for fp16); reductions run from hooks.

        ``sync=False`` for all but the last micro-batch of a step: stages 0-1
        then only accumulate locally.
        """
        self.reducer.begin(sync)
        (loss * self.scaler.scale if self.scaler.scale != 1.0 else loss).backward()
        self.reducer.finish()
        if self.gatherer is not None:
            self.gatherer.release_all()

    def step(self, lr: float, loss: torch.Tensor | None = None) -> StepResult:
        """Unscale, check overflow (all ranks agree), clip, update, re-assemble params.

        ``loss``: this rank's loss of the step; a non-finite one skips the step
        like a non-finite gradient does, even when the gradients are finite.
        """
        grads = [u.grad_shard for u in self.units]
        dp = self.ps.dp_group if self.plan.optimizer else None
        norm = global_grad_norm(self.optimizer, grads, self.ps.tp_group, dp) / self.scaler.scale
        # Every rank must take the same decision: agree on overflow over the world.
        flag = torch.tensor([0.0 if math.isfinite(norm) else 1.0], device=self.ps.device)
        if loss is not None:  # on the device: no extra synchronization
            flag += (~torch.isfinite(loss.detach())).to(flag.dtype).reshape(1)
        self.ps.world_group.all_reduce(flag)
        skipped = bool(flag.item() > 0)
        self.scaler.update(skipped)
        if skipped:
            return StepResult(norm, True, self.scaler.scale)
        coef = 1.0 / self.scaler.scale
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            coef *= self.cfg.clip_grad / (norm + 1e-6)
        found = None
        if self.offload is not None:
            found = self.optimizer.step_flat(self.offload.grads_to_host(self.units), lr, coef,
                                             out=self.offload.out)
        elif self._flat_step:
            found = self.optimizer.step_flat(self.flat_grads, lr, coef)
        else:
            self.optimizer.step(grads, lr, coef)
        if found is not None and bool(found.item()):
            # the norm was finite on every rank, so this means memory changed under us
            log.warning("optimizer step met a non-finite gradient the norm did not show")
        self.publish_params(after_step=True)
        return StepResult(norm, False, self.scaler.scale)

    @torch.no_grad()
    def publish_params(self, after_step: bool = False) -> None:
        """Master -> this rank's parameter shard -> (stages 1-2) all-gather.

        ``after_step``: called right after an optimizer step, so an offloaded
        step's parameter copy is current (else the master is the source).
        """
        if self.offload is not None:
            self.offload.params_to_device(self.units, self.flat_master, after_step)
        elif self.separate_master:
            for u, m in zip(self.units, self.optimizer.master):
                u.shard.copy_(m)
        if not self.plan.optimizer:
            return
        works = [gather_pieces(u.full, u.shard, self.ps.dp_group,
                               self.cfg.allgather_bucket_size, async_op=True)
                 for u in self.units if not u.partition_params]
        for w in works:
            w.wait()

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter holds its full (TP-local) value inside the block.

        Stage 3 all-gathers the partitioned units and frees them on exit; other
        stages hold full parameters anyway. For reading weights (checkpoints,
        export, tests), not for running the model.
        """
        if self.gatherer is None:
            yield
            return
        for u in self.gatherer.units:
            u.finish_gather(self.cfg.allgather_bucket_size)
        try:
            yield
        finally:
            self.gatherer.release_all()

    # -- accounting ----------------------------------------------------------------
    def model_state_bytes(self) -> dict:
        """Bytes of parameters, gradients and optimizer states held by this rank now,
        read from the storages actually allocated."""
        def nbytes(t):
            return 0 if t is None else t.untyped_storage().nbytes()
        params = nbytes(self.flat_params) + sum(
            u.shard.untyped_storage().nbytes() + u.full.untyped_storage().nbytes()
            for u in self.units if u.partition_params)
        opt = self.optimizer.state_bytes() + nbytes(self.flat_master)
        if self.offload is not None:
            opt += self.offload.nbytes()
        # Offloaded, the optimizer's bytes are host memory, not accelerator memory.
        host = opt if self.offload is not None else 0
        return {"params": params, "grads": nbytes(self.flat_grads), "optimizer": opt,
                "total": params + nbytes(self.flat_grads) + opt, "host": host}

    def comm_temp_bytes(self) -> int:
        return self.reducer.temp_bytes()


def apply_zero(model: nn.Module, ps: ParallelState, cfg: ZeroConfig, values=None,
               unit_modules=None, recompute: RecomputePhase | None = None) -> ZeroEngine:
    """Wrap ``model`` for ZeRO stage ``cfg.stage`` over ``ps.dp_group``.

    ``values(name, param, lo, hi)``: fp32 values of a TP-local flat range of a
    parameter, for a model built on the meta device (e.g.
    ``InitValues(seed, model.init_of)``); default: the parameters' own (fp32)
    data. The engine keeps exact fp32 master weights and makes the parameters
    ``cfg.params_dtype`` views of its buffers.
    ``unit_modules``: the modules whose parameters stage 3 gathers as one unit
    (default ``model.blocks`` when it exists).
    ``recompute``: the :class:`RecomputePhase` activation checkpointing sets,
    so stage 3 keeps a recomputed block's parameters for its backward.
    """
    if unit_modules is None and hasattr(model, "blocks"):
        unit_modules = list(model.blocks)
    return ZeroEngine(model, ps, cfg, values, unit_modules, recompute)
