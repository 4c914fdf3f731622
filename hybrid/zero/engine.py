"""apply_zero: ZeRO-DP applied to a model from outside.

    engine = apply_zero(model, ps, cfg)
    for tokens, labels in micro_batches:
        engine.backward(model(tokens, labels) / n, sync=is_last)
    result = engine.step(lr)

What each stage keeps on a rank (Psi = this TP rank's parameters, N = DP size):

=======  ==============  =================  =======================================
stage    parameters      gradients          fp32 master + Adam moments
=======  ==============  =================  =======================================
0        all             all (all-reduce)   all
1        all             all (reduce-scat.) 1/N
2        all             1/N                1/N
3        1/N             1/N                1/N
=======  ==============  =================  =======================================

All parameters live as views of flat buffers (one per dtype, or one per
module at stage 3), gradients too at stages 0-1 (``param.grad`` is a view, so
autograd accumulates in place) -- no per-parameter allocation in a step.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from hybrid.kernels.adam import has_adam_kernel
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import is_tp_split
from hybrid.zero.flat_unit import FlatUnit, gather_pieces
from hybrid.zero.grad_sync import GradReducer
from hybrid.zero.loss_scaler import LossScaler
from hybrid.zero.offload import OptimizerOffload
from hybrid.zero.optimizer import ShardedAdamW, global_grad_norm
from hybrid.zero.param_sync import ParamGatherer

log = logging.getLogger("hybrid")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float


def model_dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32


def _bucket_units(params, ps, bucket: int, owns_all: bool, tag: str) -> list[FlatUnit]:
    """Pack params, last first (their grads are ready first), into <= bucket-element units."""
    units, cur, size = [], [], 0
    for p in reversed(params):
        if cur and size + p.numel() > bucket:
            units.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    if cur:
        units.append(cur)
    return [FlatUnit(u, ps.dp_group, owns_all=owns_all, name=f"{tag}{i}")
            for i, u in enumerate(units)]


class ZeroEngine:
    def __init__(self, model: nn.Module, ps: ParallelState, cfg, unit_modules=None):
        self.model, self.ps, self.cfg = model, ps, cfg
        self.stage = cfg.zero_stage
        self.dtype = model_dtype(cfg)
        self.scaler = LossScaler.from_config(cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        fp32_values = {id(p): p.detach().float().clone() for p in params}
        self.gatherer = None
        owners = []
        if self.stage == 3:
            owners = self._module_owners(model, params, unit_modules)
            small = [p for p in params
                     if p.numel() < cfg.zero_param_persistence_threshold]
            self.units = _bucket_units(small, ps, cfg.reduce_bucket_size, False, "persistent")
            self.units += [u for _, u in owners]
        else:
            self.units = _bucket_units(params, ps, cfg.reduce_bucket_size, self.stage == 0,
                                       "bucket")
        self._allocate(fp32_values, owners)
        if owners:
            self.gatherer = ParamGatherer(owners, cfg.allgather_bucket_size)
        self.reducer = GradReducer(self.units, self.stage, ps.dp_group, cfg.reduce_bucket_size,
                                   cfg.overlap_comm,
                                   self.gatherer.after_reduce if self.gatherer else None)
        self._build_optimizer(fp32_values)

    # -- construction ------------------------------------------------------------
    def _module_owners(self, model, params, unit_modules):
        """Stage 3: one partitioned unit per module (e.g. block), one for the rest (root)."""
        thr = self.cfg.zero_param_persistence_threshold
        modules = list(unit_modules) if unit_modules is not None else []
        taken, owners = set(), []
        for i, m in enumerate(modules):
            ps_ = [p for p in m.parameters() if p.requires_grad and p.numel() >= thr]
            taken.update(id(p) for p in ps_)
            if ps_:
                owners.append((m, FlatUnit(ps_, self.ps.dp_group, partition_params=True,
                                           name=f"module{i}")))
        rest = [p for p in params if id(p) not in taken and p.numel() >= thr]
        if rest:
            owners.insert(0, (model, FlatUnit(rest, self.ps.dp_group, partition_params=True,
                                              name="root")))
        return owners

    def _allocate(self, fp32_values, owners) -> None:
        dev, dt = self.ps.device, self.dtype
        shared = [u for u in self.units if not u.partition_params]
        flat = torch.empty(sum(u.padded for u in shared), dtype=dt, device=dev)
        self.flat_params = flat
        off = 0
        for u in shared:
            u.bind(flat[off: off + u.padded], [fp32_values[id(p)] for p in u.params])
            off += u.padded
        for u in self.units:
            if u.partition_params:
                u.bind(torch.empty(u.padded, dtype=dt, device=dev),
                       [fp32_values[id(p)] for p in u.params])
                u.release()
        if self.stage <= 1:  # full gradients, and param.grad are views of them
            self.flat_grads = torch.zeros(sum(u.padded for u in self.units), dtype=dt, device=dev)
            off = 0
            for u in self.units:
                u.grad_full = self.flat_grads[off: off + u.padded]
                u.grad_shard = u.grad_full[u.own_lo: u.own_hi]
                for p, o in zip(u.params, u.offsets):
                    p.grad = u.grad_full[o: o + p.numel()].view_as(p)
                off += u.padded
        else:
            self.flat_grads = torch.zeros(sum(u.own_hi - u.own_lo for u in self.units),
                                          dtype=dt, device=dev)
            off = 0
            for u in self.units:
                n = u.own_hi - u.own_lo
                u.grad_shard = self.flat_grads[off: off + n]
                off += n

    def _build_optimizer(self, fp32_values) -> None:
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
        # fp32 master weights: the parameter shards themselves when the model is
        # fp32 and on-device; otherwise one flat fp32 buffer (on the host if offloaded).
        self.separate_master = self.dtype != torch.float32 or cfg.offload_optimizer
        if self.separate_master:
            dev = torch.device("cpu") if cfg.offload_optimizer else self.ps.device
            n = sum(u.own_hi - u.own_lo for u in self.units)
            pin = cfg.offload_optimizer and torch.cuda.is_available()
            self.flat_master = torch.empty(n, dtype=torch.float32, device=dev, pin_memory=pin)
            master, off = [], 0
            for u in self.units:
                part = self.flat_master[off: off + u.own_hi - u.own_lo]
                self._fill_master(u, part, fp32_values)
                master.append(part)
                off += part.numel()
        else:
            self.flat_master = None
            master = [u.shard for u in self.units]
        self.optimizer = ShardedAdamW(master, decay, split, (cfg.adam_beta1, cfg.adam_beta2),
                                      cfg.adam_eps, cfg.weight_decay, self.flat_master)
        self.offload = (OptimizerOffload(self.units, self.dtype, self.flat_grads, self.stage)
                        if cfg.offload_optimizer else None)
        # One fused pass over the flat shard where the gradient shard is already
        # flat and in master order (stages 2-3) and a compiled kernel exists;
        # otherwise torch's fused AdamW per unit.
        self._flat_step = (self.offload is None and self.separate_master and self.stage >= 2
                           and has_adam_kernel(self.flat_master.device))

    @staticmethod
    def _fill_master(u: FlatUnit, part: torch.Tensor, fp32_values) -> None:
        """Master = the exact fp32 init, not its rounded low-precision copy."""
        part.zero_()
        for i, plo, ulo, n in u.segments(u.own_lo, u.own_hi):
            v = fp32_values[id(u.params[i])].reshape(-1)[plo: plo + n]
            part[ulo - u.own_lo: ulo - u.own_lo + n].copy_(v)

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

    def step(self, lr: float) -> StepResult:
        """Unscale, check overflow (all ranks agree), clip, update, re-assemble params."""
        grads = [u.grad_shard for u in self.units]
        dp = None if self.stage == 0 else self.ps.dp_group
        norm = global_grad_norm(self.optimizer, grads, self.ps.tp_group, dp) / self.scaler.scale
        # Every rank must take the same decision: agree on overflow over the world.
        flag = torch.tensor([0.0 if math.isfinite(norm) else 1.0], device=self.ps.device)
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
        if self.stage == 0:
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


def apply_zero(model: nn.Module, ps: ParallelState, cfg, unit_modules=None) -> ZeroEngine:
    """Wrap ``model`` for ZeRO stage ``cfg.zero_stage`` over ``ps.dp_group``.

    ``unit_modules``: the modules whose parameters stage 3 gathers as one unit
    (default ``model.blocks`` when it exists). The model must be fp32 here; the
    engine keeps the fp32 values as master weights and casts the model's
    parameters to ``--bf16``/``--fp16``.
    """
    if unit_modules is None and hasattr(model, "blocks"):
        unit_modules = list(model.blocks)
    return ZeroEngine(model, ps, cfg, unit_modules)
