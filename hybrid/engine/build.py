"""``hybrid.initialize``: a model and a ds_config in, the engine out
(:class:`~hybrid.engine.api.Engine`).

It joins torchrun's job (or takes a :class:`ParallelState`), reads the ds_config onto the
defaults of hybrid's flags (:mod:`hybrid.config.deepspeed`) and checks them in one place,
resolves the optimizer and the schedule (:mod:`hybrid.engine.optimizer`), builds the ZeRO
engine over the model (:func:`hybrid.zero.apply_zero`) with every replica starting from
DP rank 0's values, and wraps it in DeepSpeed's verbs. It leaves torch's global
generators as it found them ([Note: the user's RNG] in :mod:`hybrid.engine.api`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybrid.checkpoint.api_state import SaveClaims
from hybrid.checkpoint.ownership import RunIdentity
from hybrid.config import Flags, TrainConfig, build_config
from hybrid.config.deepspeed import apply_ds_config, load_ds_config
from hybrid.config.kernels import kernel_config_from_env
from hybrid.config.kinds import INT, typed
from hybrid.engine.api import Engine
from hybrid.engine.ds_schedulers import cycles_momentum, kind_of
from hybrid.engine.optimizer import resolve_optimizer, resolve_schedule
from hybrid.engine.progress import Progress
from hybrid.engine.surface import EngineOptimizer, dataloader_of
from hybrid.engine.zero_context import init_values, take_parts
from hybrid.errors import ConfigError
from hybrid.kernels import settings as kernel_settings
from hybrid.kernels.dtypes import DTYPES
from hybrid.parallel.state import ParallelState, init_distributed
from hybrid.parallel.teardown import teardown_at_exit
from hybrid.recompute.phase import RecomputePhase
from hybrid.tensor_parallel import InitValues, seed_all
from hybrid.train.orphans import end_with_launcher
from hybrid.zero import apply_zero
from hybrid.zero.units import is_expert

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, Dataset

log = logging.getLogger("hybrid")


_WHOLE = "_hybrid_gathered_whole"  # set by gather_whole on a module instance


def gather_whole(module: nn.Module, on: bool = True) -> None:
    """Mark ``module`` (off: unmark) to be gathered as one ZeRO stage-3 unit with everything
    under it, in place of the blocks it holds (an MoE layer whose experts a router picks
    per token, so no per-expert hook order is fixed). Read when the engine is built
    (:func:`_units`); DeepSpeed's ``set_z3_leaf_modules`` comes here."""
    if on:
        setattr(module, _WHOLE, True)
    elif hasattr(module, _WHOLE):
        delattr(module, _WHOLE)


def gathered_whole(module: nn.Module) -> bool:
    """Whether :func:`gather_whole` marked ``module``."""
    return getattr(module, _WHOLE, False)


def _units(model: nn.Module) -> list[nn.Module] | None:
    """Stage 3's gather units: the longest ModuleList of same-type blocks (a
    transformer's layers), found once, and the modules :func:`gather_whole` marked: a
    marked module takes the place of the blocks inside it, and one inside a block
    changes nothing (the block is gathered whole already). None lets the engine use the
    whole model."""
    best = None
    for m in model.modules():
        if (isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(b) for b in m}) == 1
                and (best is None or len(m) > len(best))):
            best = m
    blocks = list(best) if best is not None else []
    marked = [m for m in model.modules() if gathered_whole(m)]
    if not marked:
        return blocks or None
    inside = {id(sub): m for m in marked for sub in m.modules() if sub is not m}
    wholes = [m for m in marked if id(m) not in inside]  # the outermost marked ones
    within = {id(sub) for b in blocks for sub in b.modules()}
    units = [b for b in blocks if id(b) not in inside]
    units += [m for m in wholes if id(m) not in within]
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(units, key=lambda m: order[id(m)]) or None


def configure_kernels(environ: Mapping[str, str], cache_dir: str | None = None) -> None:
    """The kernels' settings at an API entry point (:func:`initialize`, the Trainer):
    ``environ``'s ``HYBRID_*`` when no entry point set them before, else those in force;
    ``cache_dir``, when given, moves the cache (``TrainingArguments.kernel_cache_dir``)."""
    cfg = (kernel_settings.current() if kernel_settings.configured()
           else kernel_config_from_env(environ))
    if cache_dir is not None:
        cfg = replace(cfg, cache_dir=cache_dir)
    kernel_settings.configure(cfg)


@contextlib.contextmanager
def _rng_kept(device: torch.device) -> Iterator[None]:
    """The global generators of the CPU and of ``device`` as they were (module note)."""
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        yield


def initialize(model: nn.Module, config: str | os.PathLike | Mapping | None = None,
               model_parameters: Any = None, optimizer: Any = None, lr_scheduler: Any = None,
               training_data: Dataset | None = None, *,
               parallel_state: ParallelState | None = None, tensor_parallel_size: int = 1,
               seed: int = 1234, collate_fn: Callable[[list[Any]], Any] | None = None,
               recompute_phase: RecomputePhase | None = None, caller: str = "hybrid.initialize",
               tied: Collection[str] = (), engine_type: type[Engine] = Engine
               ) -> tuple[Engine, EngineOptimizer, DataLoader | None, Any]:
    """(engine, optimizer, dataloader, lr_scheduler) as ``deepspeed.initialize`` returns
    them: ``optimizer`` is the engine's :class:`EngineOptimizer`, ``dataloader`` a
    DataLoader over this DP rank's share of ``training_data`` (None without it;
    ``collate_fn`` its collate function), ``lr_scheduler`` what sets the rates (a
    client's, the config's :class:`~hybrid.engine.optimizer.ConfigSchedule`, or
    None: a client optimizer's groups keep their rates).

    ``config``: a ds_config path or dict (None: hybrid's defaults), each key's value
    checked against its type as from a file. ``model_parameters``, ``optimizer``,
    ``lr_scheduler``: as DeepSpeed's, each way :mod:`hybrid.engine.optimizer`
    lists (every parameter that requires grad must be given). ``parallel_state``: an existing
    :class:`ParallelState` (default: joined from torchrun's environment with
    ``tensor_parallel_size`` adjacent ranks per TP group, for a model built from
    hybrid's TP layers on that state). ``seed``: the run seed (hybrid's ``--seed``:
    the TP stream and a ``zero_init`` model's draws; torch's global generators are
    left as they were). ``recompute_phase``: the flag a function-level activation
    checkpoint sets around its recompute (:mod:`hybrid.deepspeed.checkpointing`), so
    stage 3 keeps a recomputed module's parameters for its backward. ``caller``: the
    door's name in messages. ``tied``: names of parameters every rank of
    ``parallel_state.embedding_group`` holds a copy of (:func:`hybrid.zero.apply_zero`);
    ``engine_type``: the engine class (:mod:`hybrid.deepspeed.pipe_engine`'s for a
    pipeline). A ``config`` key or an argument of the wrong type or
    value is one ConfigError naming it (``model`` or ``parallel_state`` of the wrong
    class: TypeError).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}(model=...) takes a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if parallel_state is not None and not isinstance(parallel_state, ParallelState):
        raise TypeError(f"{caller}(parallel_state=...) takes a ParallelState or None, "
                        f"got {type(parallel_state).__name__}")
    tensor_parallel_size = typed(tensor_parallel_size, INT, f"{caller}(tensor_parallel_size=...)")
    seed = typed(seed, INT, f"{caller}(seed=...)")
    if parallel_state is None:  # this door joins torchrun's job: it is the worker's entry
        end_with_launcher(os.environ)  # no rank outlives its launcher (train/orphans.py)
    configure_kernels(os.environ)  # an entry point for the kernels too: HYBRID_*, once
    ps = parallel_state or init_distributed(tensor_parallel_size)
    if ps.cp_size > 1:  # a user's model would have to take its CP positions and loss mean
        raise ConfigError(f"{caller}: the parallel_state has context parallelism "
                          f"(CP {ps.cp_size}), which only hybrid's GPT takes "
                          f"(scripts/pretrain_gpt.py --context-parallel-size); build it with "
                          f"context_parallel_size=1")
    # the checks name the seed as it was given here, not as --seed
    flags = Flags(seed=seed, given_as={"seed": f"{caller}(seed=...)"})
    ds: dict = {}
    if config is not None:
        source = os.fspath(config) if isinstance(config, (str, os.PathLike)) else "<dict>"
        ds = load_ds_config(config)
        # OneCycle and LRRangeTest are scheduler objects of this door (ds_schedulers.py),
        # not points of the flags' schedule
        flags.ds_config_notes = apply_ds_config(
            flags, {k: v for k, v in ds.items() if not (k == "scheduler" and kind_of(v))},
            ps.dp_size, source=source)
    # under a pipeline (a PipelineModule's layout) each stage trains on its own DP x TP x
    # CP ranks: the batch arithmetic (micro-batches = global / (micro x DP)) is one stage's
    cfg = build_config(flags, ps.world_size // ps.pp_size)
    # (checked alike on every rank, before the first collective)
    client = resolve_optimizer(model, model_parameters, optimizer, lr_scheduler, cfg.adamw,
                               cfg.lr_schedule.lr, caller,
                               torch_adamw=cycles_momentum(ds.get("scheduler")))
    # (by name, before the engine points the client's groups at its shards)
    named = {id(p): n for n, p in model.named_parameters()}
    members = (None if client is None else
               [[named[id(p)] for p in g["params"]] for g in client.param_groups])
    drop_last = bool(ds.get("dataloader_drop_last") or False)
    if ps.rank == 0:  # one warning per key the file set that this door does not use
        for note in flags.ds_config_notes + _loop_only(flags):
            if not (training_data is not None and note.startswith("dataloader_drop_last:")):
                log.warning("%s: ds_config %s", caller, note)
    with _rng_kept(ps.device):
        engine = _build(model, cfg, ps, recompute_phase, client,
                        lambda optim: resolve_schedule(lr_scheduler, ds, cfg, optim, caller),
                        tied, engine_type)
    engine.progress = Progress(ds, engine)  # (its step 0 line, with steps_per_print)
    engine.group_members = members
    engine.save_claims = SaveClaims(RunIdentity.of_launch(os.environ))  # this launch's run
    loader: DataLoader | None = None
    if training_data is not None:
        loader = engine.training_dataloader = dataloader_of(
            training_data, ps, cfg.loop.micro_batch_size, collate_fn, drop_last)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _build(model: nn.Module, cfg: TrainConfig, ps: ParallelState,
           recompute_phase: RecomputePhase | None, client: torch.optim.Optimizer | None,
           schedule_of: Callable[[EngineOptimizer], Any], tied: Collection[str] = (),
           engine_type: type[Engine] = Engine) -> Engine:
    """The engine of ``model`` (inside :func:`_rng_kept`: seeding hybrid's streams
    touches the global generators), stepped by ``client`` (None: hybrid's AdamW) and
    scheduled by ``schedule_of(engine optimizer)``."""
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    # built under zero_init(): the engine takes the parts its constructors left
    # (zero_build.py); built on meta: it draws this rank's shard from the modules' own
    # initializers (zero_context.py); else every replica takes DP rank 0's values
    parts = take_parts(model)  # (the parameters zero_init() cut are meta from here)
    on_meta = any(p.is_meta for p in model.parameters())
    values = None
    if on_meta:  # hybrid's own GPT knows its init; other models use their modules'
        init_of = getattr(model, "init_of", None)
        values = (InitValues(cfg.seed, init_of) if init_of is not None
                  else init_values(model, cfg.seed, parts, ps))
    if not on_meta:
        _broadcast_from_first_replica(model, ps)
    if on_meta:
        _buffers_to(model, ps.device)
    else:
        model.to(ps.device)
    _frozen_to(model, DTYPES[cfg.precision.params_dtype])
    zero = apply_zero(model, ps, cfg.zero, precision=cfg.precision, offload=cfg.offload,
                      adamw=replace(cfg.adamw, clip_norm_of=engine_type.clip_norm_of),
                      values=values, unit_modules=_units(model), recompute=recompute_phase,
                      client=client, decay="all", tied=tied)
    optim = EngineOptimizer([p for p in model.parameters() if p.requires_grad], cfg.adamw, zero,
                            client)
    engine = engine_type(model, cfg, ps, zero, rng, optim, schedule_of(optim))
    teardown_at_exit(ps, engine)  # closed, then the groups destroyed, at exit if not before
    for p in model.parameters():  # GatheredParameters finds the engine from a parameter
        # an attribute of the tensor: torch's stubs declare none beyond its own
        p.hybrid_engine = engine  # type: ignore[attr-defined]
    return engine


# ds_config settings only pretrain_gpt.py's loop uses: (Flags field, the key, why no effect)
_LOOP_ONLY = (
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


@torch.no_grad()
def _frozen_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point parameters in the training dtype, as DeepSpeed's
    ``module.bfloat16()`` / ``half()`` leaves them: ZeRO casts the parameters that train
    (its units are in ``dtype``), and a frozen base left in fp32 beside them fails the
    first bf16 matmul. (Stage 3 partitions them in ``dtype`` anyway: [Note: frozen
    units].) Buffers keep their dtype: torch's norms take a bf16 input with fp32
    statistics, which stay the more exact."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and not p.is_meta \
                and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            module._buffers[name] = b.to(device)


@torch.no_grad()
def _broadcast_from_first_replica(model: nn.Module, ps: ParallelState) -> None:
    """Every DP replica starts from DP rank 0's parameters and buffers (as DDP does),
    whatever each process's own random init drew; an expert split over EP from the first
    rank of its expert DP group (the ranks holding the same experts)."""
    if ps.dp_size == 1:
        return
    for t in list(model.parameters()) + list(model.buffers()):
        (ps.edp_group if is_expert(t) else ps.dp_group).broadcast(t.data, src=0)
