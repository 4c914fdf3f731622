"""``deepspeed.initialize`` and ``deepspeed.add_config_arguments`` over hybrid's engine.

:func:`initialize` takes DeepSpeed's arguments, resolves them to what
:func:`hybrid.engine.build.initialize` takes (the config from ``config``,
``config_params`` or ``args.deepspeed_config``; the layout from ``mpu`` when
it is a :class:`ParallelState`) and refuses, one ConfigError each, what hybrid
cannot honour yet. Everything else is that function's: the same engine.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hybrid.config.deepspeed import load_ds_config
from hybrid.deepspeed.checkpointing import PHASE
from hybrid.deepspeed.moe.utils import attach_expert_groups, expert_parallel_size, has_moe_layers
from hybrid.deepspeed.ops.adam import as_config_block
from hybrid.deepspeed.pipe import PipelineModule
from hybrid.deepspeed.pipe_engine import PipelineEngine, RepeatingLoader
from hybrid.engine import build
from hybrid.engine.api import Engine
from hybrid.engine.surface import EngineOptimizer
from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState, init_distributed
from hybrid.train.orphans import end_with_launcher

_WHERE = "deepspeed.initialize"


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments on ``parser`` (returned): ``--deepspeed`` (a
    marker for the script's own use), ``--deepspeed_config FILE`` (read by
    :func:`initialize` from ``args``), and the deprecated ``--deepscale`` and
    ``--deepscale_config`` of the same meanings."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed's arguments (hybrid's engine)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="marks a DeepSpeed run (for the script; hybrid reads no more)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the ds_config JSON file initialize(args=...) reads")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config(args: argparse.Namespace | None, config: str | os.PathLike | Mapping | None,
            config_params: str | os.PathLike | Mapping | None
            ) -> str | os.PathLike | Mapping | None:
    """The one config of the call: ``config``, or ``config_params`` (its older name), or
    ``args.deepspeed_config`` (``args.deepscale_config``); two of them is an error."""
    given = []
    if config is not None:
        given.append(("config", config))
    if config_params is not None:
        given.append(("config_params", config_params))
    for name in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, name, None)
        if value is not None:
            given.append((f"args.{name}", value))
    if len(given) > 1:
        raise ConfigError(f"{_WHERE}: two configs ({given[0][0]} and {given[1][0]}): pass one")
    return given[0][1] if given else None


def initialize(args: argparse.Namespace | None = None, model: nn.Module | None = None,
               optimizer: Any = None, model_parameters: Any = None,
               training_data: Dataset | None = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: object = None,
               dist_init_required: bool | None = None,
               collate_fn: Callable[[list[Any]], Any] | None = None,
               config: str | os.PathLike | Mapping | None = None, mesh_param: object = None,
               config_params: str | os.PathLike | Mapping | None = None, *,
               parallel_state: ParallelState | None = None, tensor_parallel_size: int = 1,
               seed: int = 1234
               ) -> tuple[Engine, EngineOptimizer, Iterable[Any] | None, Any]:
    """``(engine, optimizer, training_dataloader, lr_scheduler)``, as DeepSpeed's.

    ``config`` / ``config_params`` / ``args.deepspeed_config``: the ds_config (a path
    or a dict; exactly one, or none for hybrid's defaults). ``model_parameters``,
    ``optimizer``, ``lr_scheduler``: as DeepSpeed takes them (a list, a
    ``requires_grad`` filter or groups; a ``torch.optim`` optimizer or a callable
    of the parameters; a scheduler over it or a callable of it:
    :mod:`hybrid.engine.optimizer`; a FusedAdam or DeepSpeedCPUAdam of one AdamW group
    with no scheduler runs as hybrid's own AdamW: :mod:`hybrid.deepspeed.ops.adam`).
    ``training_data``: a dataset; the loader returned gives this
    DP rank's share, ``train_micro_batch_size_per_gpu`` samples a batch,
    ``collate_fn`` collating them (DeepSpeed's DistributedSampler, same order every
    epoch; ``dataloader_drop_last`` honoured). ``mpu``: a :class:`ParallelState`
    (hybrid's layout object), as ``parallel_state``. ``dist_init_required`` False
    with no process group in a multi-process job is an error, as in DeepSpeed;
    ``distributed_port`` (DeepSpeed's MPI discovery) is unused.
    Keyword-only, hybrid's own: ``parallel_state``, ``tensor_parallel_size``,
    ``seed`` (:func:`hybrid.initialize`).

    Refused, one ConfigError each naming what to do: a trainable parameter left out
    of ``model_parameters`` or of the optimizer's groups, another ``mpu``,
    ``mesh_param``.

    ``model`` a :class:`~hybrid.deepspeed.pipe.PipelineModule`: the layout is the
    module's (``mpu``, if given, must be it), and the engine a
    :class:`~hybrid.deepspeed.pipe_engine.PipelineEngine` (``train_batch``); the loader
    over ``training_data`` goes through this DP rank's share in order (not shuffled,
    as DeepSpeed's pipeline loader) and starts again at its end.
    """
    if model is None:
        raise TypeError(f"{_WHERE}(model=...) is required: the torch.nn.Module to train")
    cfg = _config(args, config, config_params)
    fused = None  # a FusedAdam run as hybrid's own AdamW (ops/adam.py)
    ds = load_ds_config(cfg) if cfg is not None and optimizer is not None else {}
    block = as_config_block(optimizer, lr_scheduler, ds)
    if block is not None:
        fused, optimizer = optimizer, None
        model_parameters = list(fused.param_groups[0]["params"])
        cfg = ds = {**ds, "optimizer": block}
    out = _initialize(model, cfg, optimizer, model_parameters, training_data, lr_scheduler,
                      mpu, dist_init_required, collate_fn, mesh_param, parallel_state,
                      tensor_parallel_size, seed)
    if fused is None:
        return out
    engine, optim, loader, sched = out
    fused.param_groups = optim.param_groups  # a rate written there applies, as DeepSpeed's
    fused.stepped_by = engine
    # DeepSpeed's engine has no scheduler for a client optimizer without one
    return engine, optim, loader, sched if "scheduler" in ds else None


def _initialize(model: nn.Module, cfg: str | os.PathLike | Mapping | None, optimizer: Any,
                model_parameters: Any, training_data: Dataset | None, lr_scheduler: Any,
                mpu: object, dist_init_required: bool | None,
                collate_fn: Callable[[list[Any]], Any] | None, mesh_param: object,
                parallel_state: ParallelState | None, tensor_parallel_size: int, seed: int
                ) -> tuple[Engine, EngineOptimizer, Iterable[Any] | None, Any]:
    """:func:`initialize` once its optimizer is resolved (its doc)."""
    if isinstance(model, PipelineModule):  # (its layout was fixed when it was built)
        if ((mpu is not None and mpu is not model.ps)
                or (parallel_state is not None and parallel_state is not model.ps)):
            raise ConfigError(f"{_WHERE}(mpu=...) with a PipelineModule: the module holds "
                              f"its layout; pass it as PipelineModule(parallel_state=...) "
                              f"and leave mpu None")
        if has_moe_layers(model)[0]:
            if expert_parallel_size(model) > 1:
                raise ConfigError(f"{_WHERE}: a PipelineModule with deepspeed.moe layers of "
                                  f"ep_size > 1; hybrid splits DeepSpeed's experts over EP "
                                  f"outside a pipeline only: use ep_size=1")
            attach_expert_groups(model, model.ps)
        return _pipeline(model, cfg, optimizer, model_parameters, training_data, lr_scheduler,
                         collate_fn, seed)
    if mpu is not None:
        if not isinstance(mpu, ParallelState):
            raise ConfigError(f"{_WHERE}(mpu=...): hybrid takes its layout as a "
                              f"ParallelState (mpu= or parallel_state=), or from torchrun's "
                              f"environment with tensor_parallel_size=; got "
                              f"{type(mpu).__name__}")
        if parallel_state is not None and parallel_state is not mpu:
            raise ConfigError(f"{_WHERE}: mpu= and parallel_state= are two layouts: pass one")
        parallel_state = mpu
    if mesh_param is not None:
        raise ConfigError(f"{_WHERE}(mesh_param=...): hybrid has no sequence x data mesh in "
                          f"this door; pass mesh_param=None")
    if (dist_init_required is False and parallel_state is None and not dist.is_initialized()
            and int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise ConfigError(f"{_WHERE}(dist_init_required=False): no process group yet; call "
                          f"deepspeed.init_distributed() first or leave dist_init_required "
                          f"None")
    if has_moe_layers(model)[0]:
        parallel_state = _with_experts(model, parallel_state, tensor_parallel_size)
    return build.initialize(model, cfg, model_parameters, optimizer, lr_scheduler, training_data,
                          parallel_state=parallel_state, tensor_parallel_size=tensor_parallel_size,
                          seed=seed, collate_fn=collate_fn, recompute_phase=PHASE,
                          caller=_WHERE)


def _with_experts(model: nn.Module, parallel_state: ParallelState | None,
                  tensor_parallel_size: int) -> ParallelState:
    """The layout of a model with ``deepspeed.moe.layer.MoE`` layers: its EP size theirs
    (the given layout must have it; joined from torchrun's environment with it
    otherwise), each layer given the EP group and its experts marked
    (:func:`hybrid.deepspeed.moe.utils.attach_expert_groups`)."""
    ep = expert_parallel_size(model)
    if parallel_state is None:  # (the worker's entry, as build.initialize's own join)
        end_with_launcher(os.environ)
        parallel_state = init_distributed(tensor_parallel_size, expert_model_parallel_size=ep)
    elif parallel_state.ep_group.size != ep:
        raise ConfigError(f"{_WHERE}: the model's MoE layers have ep_size {ep}, the "
                          f"parallel_state's EP group {parallel_state.ep_group.size} ranks; "
                          f"build it with expert_model_parallel_size={ep}")
    attach_expert_groups(model, parallel_state)
    return parallel_state


def _pipeline(model: PipelineModule, cfg: str | os.PathLike | Mapping | None, optimizer: Any,
              model_parameters: Any, training_data: Dataset | None, lr_scheduler: Any,
              collate_fn: Callable[[list[Any]], Any] | None, seed: int
              ) -> tuple[PipelineEngine, EngineOptimizer, Iterable[Any] | None, Any]:
    """:func:`initialize` of a PipelineModule (its doc): the engine of this stage's
    layers on the module's layout, ZeRO over this stage's DP group, the tied weights
    summed over the first and the last stage."""
    engine, optim, loader, sched = build.initialize(
        model, cfg, model_parameters, optimizer, lr_scheduler, training_data,
        parallel_state=model.ps, seed=seed, collate_fn=collate_fn, recompute_phase=PHASE,
        caller=_WHERE, tied=model.tied_parameter_names(), engine_type=PipelineEngine)
    assert isinstance(engine, PipelineEngine)
    if loader is not None:  # DeepSpeed's pipeline loader: the share in order, repeating
        assert training_data is not None  # (the loader is over it)
        ps = model.ps
        sampler: DistributedSampler = DistributedSampler(
            training_data, num_replicas=ps.dp_size, rank=ps.dp_rank, shuffle=False)
        ordered = DataLoader(training_data, batch_size=loader.batch_size, sampler=sampler,
                             collate_fn=loader.collate_fn, drop_last=loader.drop_last,
                             pin_memory=loader.pin_memory)
        repeating = RepeatingLoader(ordered)
        engine.training_dataloader = repeating
        engine.set_dataloader(repeating)
        return engine, optim, repeating, sched
    return engine, optim, loader, sched
