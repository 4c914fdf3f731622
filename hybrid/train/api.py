"""``hybrid.initialize``: ZeRO for any ``nn.Module``, with DeepSpeed's verbs.

    engine, optimizer, _, lr_scheduler = hybrid.initialize(model=model, config="ds_config.json")
    for batch in data:
        loss = engine(**batch).loss
        engine.backward(loss)      # scaled for fp16, divided by the accumulation steps
        engine.step()              # at the accumulation boundary: AdamW on the shard + LR
    engine.save_checkpoint("ckpt", client_state={"epoch": 3})

The engine is the one ``pretrain_gpt.py`` trains with (:func:`hybrid.zero.apply_zero`,
its loss scaler, offload tiers and checkpoint format), configured from a
ds_config (a path or a dict, :mod:`hybrid.config.deepspeed`) on top of the
defaults of hybrid's flags. Process groups come from torchrun's environment
(gloo on a CPU, NCCL on a GPU), or from a :class:`ParallelState` passed in.

[Note: micro-steps and steps]
As in DeepSpeed, ``backward`` and ``step`` are called every micro-batch; the
optimizer runs on the last of each ``gradient_accumulation_steps``. Each
micro-batch's loss is divided by that count, so the accumulated gradient is
the mean over the global batch. The learning rate is hybrid's schedule (the
ds_config's ``scheduler`` block or the ``--lr*`` defaults) at the step about to run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
from torch import nn

from hybrid.config import Flags, build_config
from hybrid.config.deepspeed import apply_ds_config, load_ds_config
from hybrid.config.kinds import INT, typed
from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState, init_distributed
from hybrid.tensor_parallel import InitValues, seed_all
from hybrid.train.lr_schedule import scheduled_lr
from hybrid.train.orphans import end_with_launcher
from hybrid.train.zero_context import ModuleInitValues
from hybrid.zero import apply_zero

log = logging.getLogger("hybrid")


class LRSchedule:
    """The run's learning-rate schedule as a scheduler object: ``step()`` after each
    optimizer step (the engine calls it), ``get_last_lr()``, and a state dict."""

    def __init__(self, sched, batch: int):
        self.sched, self.batch, self.steps = sched, batch, 0

    def lr_at(self, step: int) -> float:
        """The rate of 1-based optimizer step ``step``."""
        return scheduled_lr(self.sched, step, step * self.batch)

    def step(self) -> None:
        self.steps += 1

    def get_last_lr(self) -> list[float]:
        return [self.lr_at(max(1, self.steps))]

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])


def _units(model: nn.Module) -> list[nn.Module] | None:
    """Stage 3's gather units: the longest ModuleList of same-type blocks (a
    transformer's layers), found once; None lets the engine use the whole model."""
    best = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(b) for b in m}) == 1:
            if best is None or len(m) > len(best):
                best = m
    return list(best) if best is not None else None


class Engine:
    """DeepSpeed's engine verbs over one :class:`~hybrid.zero.ZeroEngine` (module note)."""

    def __init__(self, module: nn.Module, cfg, ps: ParallelState, zero, rng, schedule):
        self.module, self.cfg, self.ps, self.zero = module, cfg, ps, zero
        self.rng, self.lr_scheduler = rng, schedule
        self.gradient_accumulation_steps = cfg.num_micro_batches
        self.train_batch_size = cfg.loop.global_batch_size
        self.micro_steps = self.global_steps = 0
        self._loss: torch.Tensor | None = None  # this window's summed micro-batch losses (device)
        self.last_result = None  # the engine's StepResult of the last optimizer step

    # -- the training verbs ------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def zero_grad(self) -> None:
        """(``backward`` clears the gradients at the start of each window itself.)"""
        self.zero.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this micro-batch's ``loss`` (divided by the accumulation steps;
        gradients reduce over DP in the last micro-batch of the window)."""
        if self.micro_steps % self.gradient_accumulation_steps == 0:
            self.zero.zero_grad()
            self._loss = None
        n = self.gradient_accumulation_steps
        scaled = loss / n if n > 1 else loss
        self.zero.backward(scaled, sync=self.is_gradient_accumulation_boundary())
        self._loss = scaled.detach() if self._loss is None else self._loss + scaled.detach()
        self.micro_steps += 1

    def step(self) -> None:
        """At an accumulation boundary: the optimizer step on this rank's shard (clip,
        skip on a non-finite gradient, all-gather), then the schedule; else nothing."""
        if self.micro_steps == 0 or self.micro_steps % self.gradient_accumulation_steps:
            return
        lr = self.lr_scheduler.lr_at(self.global_steps + 1)
        self.last_result = self.zero.step(lr, loss=self._loss)
        self.global_steps += 1
        self.lr_scheduler.step()

    def get_lr(self) -> list[float]:
        return self.lr_scheduler.get_last_lr()

    # -- checkpoints (hybrid's format: atomic, reshardable) ---------------------------------
    def save_checkpoint(self, save_dir: str, tag=None, client_state: Mapping | None = None,
                        **_) -> str:
        """Collective: write step ``global_steps`` under ``save_dir`` (``tag`` must be None
        or the step: hybrid names checkpoints by iteration). ``client_state``: JSON
        values, returned by :meth:`load_checkpoint`."""
        from hybrid.checkpoint.api_state import save_engine
        return save_engine(self, save_dir, tag, dict(client_state or {}))

    def load_checkpoint(self, load_dir: str, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        **_):
        """Collective: restore the newest checkpoint (or step ``tag``) under
        ``load_dir``; returns (its path, the client_state saved with it)."""
        from hybrid.checkpoint.api_state import load_engine
        return load_engine(self, load_dir, tag, load_optimizer_states and not load_module_only,
                           load_lr_scheduler_states and not load_module_only)

    def close(self) -> None:
        """Finish the update in flight and delete any swap files."""
        self.zero.close()


def initialize(model: nn.Module, config=None, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, *, parallel_state=None,
               tensor_parallel_size: int = 1, seed: int = 1234):
    """(engine, optimizer, dataloader, lr_scheduler) as ``deepspeed.initialize`` returns
    them: ``optimizer`` is the engine's shard optimizer, ``dataloader`` None (hybrid
    does not wrap a user's data: feed each rank its own micro-batches), ``lr_scheduler``
    the run's :class:`LRSchedule`.

    ``config``: a ds_config path or dict (None: hybrid's defaults), each key's value
    checked against its type as from a file. ``model_parameters``:
    accepted when it is all of ``model.parameters()`` (hybrid shards the whole model).
    ``optimizer``/``lr_scheduler``/``training_data`` objects are refused: the engine
    runs its own AdamW and schedule (set them in the config). ``parallel_state``: an
    existing :class:`ParallelState` (default: joined from torchrun's environment with
    ``tensor_parallel_size`` adjacent ranks per TP group, for a model built from
    hybrid's TP layers on that state). ``seed``: the run seed (hybrid's ``--seed``).
    A ``config`` key or an argument of the wrong type or value is one ConfigError
    naming it (``model`` or ``parallel_state`` of the wrong class: TypeError).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hybrid.initialize(model=...) takes a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if parallel_state is not None and not isinstance(parallel_state, ParallelState):
        raise TypeError(f"hybrid.initialize(parallel_state=...) takes a ParallelState or None, "
                        f"got {type(parallel_state).__name__}")
    tensor_parallel_size = typed(tensor_parallel_size, INT,
                                 "hybrid.initialize(tensor_parallel_size=...)")
    seed = typed(seed, INT, "hybrid.initialize(seed=...)")
    for name, value in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler),
                        ("training_data", training_data)):
        if value is not None:
            raise ValueError(f"hybrid.initialize({name}=...): hybrid runs its own AdamW and "
                             f"schedule on the shards; configure them in the ds_config "
                             f"(optimizer, scheduler) and pass None")
    if model_parameters is not None:
        given = {id(p) for p in model_parameters}
        if given != {id(p) for p in model.parameters()}:
            raise ValueError("hybrid.initialize(model_parameters=...): hybrid trains every "
                             "parameter of the model; freeze with requires_grad=False")
    if parallel_state is None:  # this door joins torchrun's job: it is the worker's entry
        end_with_launcher(os.environ)  # no rank outlives its launcher (train/orphans.py)
    ps = parallel_state or init_distributed(tensor_parallel_size)
    if ps.cp_size > 1:  # a user's model would have to take its CP positions and loss mean
        raise ConfigError(f"hybrid.initialize: the parallel_state has context parallelism "
                          f"(CP {ps.cp_size}), which only hybrid's GPT takes "
                          f"(scripts/pretrain_gpt.py --context-parallel-size); build it with "
                          f"context_parallel_size=1")
    # the checks name the seed as it was given here, not as --seed
    flags = Flags(seed=seed, given_as={"seed": "hybrid.initialize(seed=...)"})
    if config is not None:
        source = os.fspath(config) if isinstance(config, (str, os.PathLike)) else "<dict>"
        flags.ds_config_notes = apply_ds_config(flags, load_ds_config(config), ps.dp_size,
                                                source=source)
    cfg = build_config(flags, ps.world_size)
    if ps.rank == 0:  # one warning per key the file set that this door does not use
        for note in flags.ds_config_notes + _loop_only(flags):
            log.warning("hybrid.initialize: ds_config %s", note)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    # built under zero_init(): the engine draws this rank's shard from the modules'
    # own initializers (zero_context.py); else every replica takes DP rank 0's values
    on_meta = any(p.is_meta for p in model.parameters())
    values = None
    if on_meta:  # hybrid's own GPT knows its init; other models use their modules'
        init_of = getattr(model, "init_of", None)
        values = (InitValues(cfg.seed, init_of) if init_of is not None
                  else ModuleInitValues(model, cfg.seed))
    if not on_meta:
        _broadcast_from_first_replica(model, ps)
    if on_meta:
        _buffers_to(model, ps.device)
    else:
        model.to(ps.device)
    zero = apply_zero(model, ps, cfg.zero, adamw=cfg.adamw, precision=cfg.precision,
                      offload=cfg.offload, values=values, unit_modules=_units(model))
    schedule = LRSchedule(cfg.lr_schedule, cfg.loop.global_batch_size)
    engine = Engine(model, cfg, ps, zero, rng, schedule)
    for p in model.parameters():  # GatheredParameters finds the engine from a parameter
        # an attribute of the tensor: torch's stubs declare none beyond its own
        p.hybrid_engine = engine  # type: ignore[attr-defined]
    return engine, zero.optimizer, None, schedule


# Settings a ds_config may make that only pretrain_gpt.py's loop uses: (Flags field,
# the ds_config key, why it does nothing here).
_LOOP_ONLY = (
    ("log_interval", "steps_per_print", "your loop prints"),
    ("tensorboard_dir", "tensorboard", "your loop logs"),
    ("timing_breakdown", "wall_clock_breakdown", "your loop times its phases"),
    ("partition_activations", "activation_checkpointing.partition_activations",
     "the API does not wrap your layers: use your model's own gradient checkpointing"),
    ("cpu_checkpointing", "activation_checkpointing.cpu_checkpointing",
     "the API does not wrap your layers"),
    ("contiguous_checkpointing", "activation_checkpointing.contiguous_memory_optimization",
     "the API does not wrap your layers"),
)


def _loop_only(flags: Flags) -> list[str]:
    """Notes for loop-only settings the file changed from their defaults."""
    return [f"{key}: no effect through hybrid.initialize ({why})"
            for field, key, why in _LOOP_ONLY if getattr(flags, field) != getattr(Flags, field)]


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            module._buffers[name] = b.to(device)


@torch.no_grad()
def _broadcast_from_first_replica(model: nn.Module, ps: ParallelState) -> None:
    """Every DP replica starts from DP rank 0's parameters and buffers (as DDP does),
    whatever each process's own random init drew."""
    if ps.dp_size == 1:
        return
    for t in list(model.parameters()) + list(model.buffers()):
        ps.dp_group.broadcast(t.data, src=0)
