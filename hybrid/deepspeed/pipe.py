"""``deepspeed.pipe``: a model as a list of layers, cut into pipeline stages.

    from hybrid.deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec
    net = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), nn.ReLU(), ...],
                         loss_fn=nn.CrossEntropyLoss(), num_stages=2)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                           training_data=trainset)
    loss = engine.train_batch()            # gradient_accumulation_steps micro-batches

The contract is DeepSpeed's (its ``runtime/pipe/module.py``), on hybrid's pipeline: the
job's ranks are laid out PP outermost, then DP (DeepSpeed's ``PipeDataParallelTopology``
and hybrid's :class:`~hybrid.parallel.state.ParallelState` agree), so the world is
``num_stages`` x DP. The layers are cut into ``num_stages`` contiguous runs
(:func:`partition`), and each rank builds only its stage's: a ``LayerSpec`` is
built there, an ``nn.Module`` given ready is kept there, anything else (a function) is
called there. The stage's forward runs its layers in order on what the stage before sent
(:mod:`hybrid.pipeline.wire`: a tensor or a tuple of tensors, shapes learnt at run time);
the last stage applies ``loss_fn(output, labels)``. :mod:`hybrid.deepspeed.pipe_engine`
runs the steps.

[Note: the same initial weights as DeepSpeed]
A ``LayerSpec`` draws its weights from torch's global generator when it is built, so the
values depend on what was drawn before. As DeepSpeed does, ``partition_method=
"parameters"`` builds every ``LayerSpec`` once, in order, to count its parameters, and
then the stage builds its own; ``seed_layers=True`` seeds the generators with
``base_seed + layer index`` before each of the stage's layers (``seed_fn`` instead, if
given). A script seeding torch before the module so gets DeepSpeed's weights on every
stage. (Counting on the meta device would draw nothing and give other weights.)

[Note: tied layers]
A :class:`TiedLayerSpec` key is built once per stage that uses it, into
``tied_modules[key]``; its ``tied_weight_attr`` parameters (``weight`` by default; the
module's other parameters stay each stage's own, as in DeepSpeed) are one weight held on
each such stage. hybrid sums such copies' gradients over ``ps.embedding_group``, the
first and the last stage's ranks (its tied word embedding's group;
:mod:`hybrid.zero.engine`, [Note: tied copies across pipeline stages]), so a key lives
on one stage, or on the first and the last: anything else is refused here. The copies
start as the first stage's (broadcast at construction, over that group) and stay equal:
both step the same master from the same summed gradient; the norm counts the first
stage's.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState, init_distributed

_WHERE = "deepspeed.pipe.PipelineModule"


class LayerSpec:
    """A layer to build later, on the stage that holds it: ``typename(*module_args,
    **module_kwargs)``; ``typename`` must be an ``nn.Module`` class."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec({typename!r}, ...): the type to build must be a "
                            f"torch.nn.Module class")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` parameters are shared by every layer of the same
    ``key`` ([Note: tied layers]). ``forward_fn(module, x)``: how this occurrence uses
    the shared module (default: its forward), e.g. an embedding's transpose as a head."""

    def __init__(self, key: str, typename: type, *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = ([tied_weight_attr] if isinstance(tied_weight_attr, str)
                                 else list(tied_weight_attr))


# -- partitioning ------------------------------------------------------------------------

def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """The boundaries (``num_parts + 1``, from 0 to ``num_items``) of ``num_items`` cut
    into ``num_parts`` runs of equal length, the first ``num_items % num_parts`` one
    longer; with fewer items than parts, one item each and the last parts empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """The boundaries of ``weights`` cut into ``num_parts`` non-empty contiguous runs whose
    sums are as even as can be: the spread (largest sum minus smallest) is the least, and
    among cuts of equal spread the one whose last run starts latest, recursively
    (DeepSpeed's ``parameters`` / ``type:`` balancing; its results are checked against
    DeepSpeed's in tests/hybrid_deepspeed/test_pipe.py). With no more items than parts:
    :func:`partition_uniform`. O(n^2 p)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[j][i]: the first i items in j runs: (spread, largest, smallest, start of run j)
    best: list[list[tuple[float, float, float, int] | None]] = [
        [None] * (n + 1) for _ in range(m + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            chosen = None
            for k in range(j - 1, i):  # run j is items k .. i-1; the first k in j-1 runs
                before = best[j - 1][k]
                if before is None:
                    continue
                run = prefix[i] - prefix[k]
                hi, lo = max(before[1], run), min(before[2], run)
                if chosen is None or hi - lo <= chosen[0]:  # (ties: the later start)
                    chosen = (hi - lo, hi, lo, k)
            best[j][i] = chosen
    bounds = [n]
    for j in range(m, 0, -1):
        cell = best[j][bounds[-1]]
        assert cell is not None  # (n > m: every count of runs up to m is reachable)
        bounds.append(cell[3])
    return bounds[::-1]


def _type_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable(layer: Any) -> int:
    """A layer's trainable parameter count; a ``LayerSpec`` is built to count it ([Note:
    the same initial weights as DeepSpeed])."""
    module = layer.build() if isinstance(layer, LayerSpec) else layer
    if not isinstance(module, nn.Module):
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def partition(layers: Sequence[Any], num_stages: int, method: str) -> list[int]:
    """The stage boundaries of ``layers`` (``num_stages + 1`` indices) by DeepSpeed's
    ``partition_method``: "uniform" (as many layers each), "parameters" (balanced by
    trainable parameter count) or "type:REGEX" (balanced by the count of layers whose
    class name REGEX matches, case-insensitive: a search, not a full match)."""
    name = method.lower()
    if name == "uniform":
        return partition_uniform(len(layers), num_stages)
    if name == "parameters":
        return partition_balanced([_trainable(layer) for layer in layers], num_stages)
    if name.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        hits = [1 if (t := _type_name(layer)) is not None and pattern.search(t) else 0
                for layer in layers]
        if not any(hits):
            raise ConfigError(f"{_WHERE}(partition_method={method!r}): no layer's type "
                              f"matches {pattern.pattern!r}")
        return partition_balanced(hits, num_stages)
    raise ConfigError(f"{_WHERE}(partition_method={method!r}): hybrid partitions by "
                      f"\"parameters\", \"uniform\" or \"type:REGEX\" (DeepSpeed's "
                      f"\"profile\" is not implemented there either)")


# -- the options, checked in one place -----------------------------------------------------

@dataclass(frozen=True)
class PipeOptions:
    """The module's arguments hybrid acts on, checked by :meth:`check`."""

    num_stages: int
    partition_method: str = "parameters"
    activation_checkpoint_interval: int = 0
    seed_layers: bool = False
    base_seed: int = 1234

    @classmethod
    def check(cls, num_stages: int | None, topology: object, partition_method: str,
              activation_checkpoint_interval: int, seed_layers: bool, base_seed: int,
              dynamic_shape: bool) -> PipeOptions:
        """The options, or one ConfigError naming the argument and what to use."""
        if topology is not None:
            raise ConfigError(f"{_WHERE}(topology=...): hybrid lays the ranks out PP "
                              f"outermost, then DP (DeepSpeed's PipeDataParallelTopology); "
                              f"pass num_stages= instead")
        if num_stages is None:
            raise ConfigError(f"{_WHERE}: pass num_stages= (the pipeline's depth)")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ConfigError(f"{_WHERE}(num_stages={num_stages!r}): a positive int")
        if dynamic_shape:
            raise ConfigError(f"{_WHERE}(dynamic_shape=True): hybrid learns the shapes "
                              f"between stages once and keeps them; pass dynamic_shape=False "
                              f"and keep every micro-batch the same size")
        if not isinstance(partition_method, str):
            raise ConfigError(f"{_WHERE}(partition_method={partition_method!r}): a string")
        interval = activation_checkpoint_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ConfigError(f"{_WHERE}(activation_checkpoint_interval={interval!r}): an "
                              f"int >= 0 (0: no activation checkpointing)")
        return cls(num_stages, partition_method, interval, bool(seed_layers), int(base_seed))


def _layout(num_stages: int, parallel_state: ParallelState | None) -> ParallelState:
    """The job's layout at PP ``num_stages``: ``parallel_state`` checked, or built from the
    process group (``deepspeed.init_distributed()``) or torchrun's environment."""
    ps = parallel_state
    if ps is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % num_stages:
            raise ConfigError(f"{_WHERE}(num_stages={num_stages}): the world of {world} "
                              f"ranks is not a whole number of {num_stages}-stage pipelines; "
                              f"pick num_stages dividing it")
        if dist.is_initialized():
            ps = ParallelState.build(1, pipeline_model_parallel_size=num_stages)
        else:
            ps = init_distributed(1, pipeline_model_parallel_size=num_stages)
    if not isinstance(ps, ParallelState):
        raise TypeError(f"{_WHERE}(parallel_state=...) takes a ParallelState, got "
                        f"{type(ps).__name__}")
    if ps.world_size % num_stages:
        raise ConfigError(f"{_WHERE}(num_stages={num_stages}): the world of "
                          f"{ps.world_size} ranks is not a whole number of "
                          f"{num_stages}-stage pipelines; pick num_stages dividing it")
    if ps.pp_size != num_stages or ps.tp_size != 1 or ps.cp_size != 1:
        raise ConfigError(f"{_WHERE}(num_stages={num_stages}): the parallel_state is PP "
                          f"{ps.pp_size} x TP {ps.tp_size} x CP {ps.cp_size}; the module "
                          f"takes PP {num_stages} x DP (build it with "
                          f"pipeline_model_parallel_size={num_stages})")
    return ps


def _seed(seed: int) -> None:
    """DeepSpeed's per-layer seeding: Python's, numpy's and torch's generators."""
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed)
    except ImportError:  # (numpy is optional here)
        pass
    torch.manual_seed(seed)


class PipelineModule(nn.Module):
    """This rank's stage of ``layers`` (module doc). DeepSpeed's arguments; refused, one
    ConfigError each: ``topology`` (pass ``num_stages``), ``dynamic_shape=True``, a
    ``partition_method`` other than parameters / uniform / type:REGEX, a partition
    leaving a stage no layer, a world ``num_stages`` does not divide, a tied key on
    stages other than one, or the first and the last ([Note: tied layers]).

    ``activation_checkpoint_interval`` k > 0: the stage's layers run in blocks of k, each
    block holding a layer with parameters (or, given ``checkpointable_layers``, made only
    of those classes) recomputed in backward by ``activation_checkpoint_func``
    (default :func:`hybrid.deepspeed.checkpointing.checkpoint`).
    Keyword-only, hybrid's own: ``parallel_state``, the job's layout (default: built at
    PP ``num_stages`` from the process group, or torchrun's environment).
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None,
                 topology: object = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None,
                 checkpointable_layers: Sequence[str] | None = None,
                 dynamic_shape: bool = False, *, parallel_state: ParallelState | None = None):
        super().__init__()
        opts = PipeOptions.check(num_stages, topology, partition_method,
                                 activation_checkpoint_interval, seed_layers, base_seed,
                                 dynamic_shape)
        self.options = opts
        self.num_stages = opts.num_stages
        self.loss_fn = loss_fn
        self.seed_fn = seed_fn
        self.activation_checkpoint_interval = opts.activation_checkpoint_interval
        if activation_checkpoint_func is None:
            from hybrid.deepspeed.checkpointing import checkpoint
            activation_checkpoint_func = checkpoint
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = (None if checkpointable_layers is None
                                      else list(checkpointable_layers))
        self._layer_specs = list(layers)
        self.parts = partition(self._layer_specs, opts.num_stages, opts.partition_method)
        counts = [b - a for a, b in zip(self.parts, self.parts[1:])]
        if 0 in counts:
            raise ConfigError(f"{_WHERE}(partition_method={opts.partition_method!r}): "
                              f"{len(self._layer_specs)} layers into {opts.num_stages} stages "
                              f"leaves stage {counts.index(0)} without a layer (layers per "
                              f"stage: {counts}); give at least one layer per stage, or "
                              f"fewer stages")
        self._tied_keys = self._check_ties()
        # (checked before the layout: a refusal needs no process group)
        self.ps = _layout(opts.num_stages, parallel_state)
        self.stage_id = self.ps.pp_rank
        self._local_start = self.parts[self.stage_id]
        self._local_stop = self.parts[self.stage_id + 1]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[Callable] = []
        self._build()
        self.to(self.ps.device)
        self._sync_tied()

    # -- construction ------------------------------------------------------------------
    def _check_ties(self) -> list[str]:
        """The keys tied across two stages (the first and the last), in sorted order."""
        stages: dict[str, set[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stages.setdefault(layer.key, set()).add(self.stage_owner(idx))
        across = []
        for key, where in sorted(stages.items()):
            if len(where) == 1:
                continue
            if where != {0, self.num_stages - 1}:
                raise ConfigError(f"{_WHERE}: TiedLayerSpec {key!r} is on stages "
                                  f"{sorted(where)} of {self.num_stages}; hybrid ties layers "
                                  f"on one stage, or on the first and the last stage only "
                                  f"(their gradients sum over its embedding group)")
            across.append(key)
        return across

    def _build(self) -> None:
        """This stage's layers, in order ([Note: the same initial weights as DeepSpeed])."""
        opts = self.options
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if opts.seed_layers:
                (self.seed_fn or _seed)(opts.base_seed + idx)
            if isinstance(layer, PipelineModule):
                raise ConfigError(f"{_WHERE}: layer {idx} is itself a PipelineModule; "
                                  f"give its layers in the list instead")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                shared = self.tied_modules[layer.key]
                fn = layer.forward_fn
                self.forward_funcs.append(shared if fn is None else _Bound(fn, shared))
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.add_module(str(idx), module)
                self.forward_funcs.append(module)
            elif callable(layer):
                self.forward_funcs.append(layer)
            else:
                raise ConfigError(f"{_WHERE}: layer {idx} ({type(layer).__name__}) is not "
                                  f"a LayerSpec, a torch.nn.Module or a callable")

    def tied_parameter_names(self) -> tuple[str, ...]:
        """The names of this rank's parameters held on both the first and the last stage
        ([Note: tied layers]); what hybrid's ZeRO engine sums over the embedding group."""
        names = []
        for key in self._tied_keys:
            if key in self.tied_modules:
                names += [f"tied_modules.{key}.{attr}" for attr in self.tied_weight_attrs[key]]
        return tuple(names)

    @torch.no_grad()
    def _sync_tied(self) -> None:
        """Every copy of a tied weight starts as the first stage's (a broadcast over
        ``ps.embedding_group``, the first and the last stage's ranks)."""
        group = self.ps.embedding_group
        if group.size == 1:
            return
        params = dict(self.named_parameters())
        for name in self.tied_parameter_names():
            if name not in params:
                raise ConfigError(f"{_WHERE}: tied_weight_attr names {name!r}, which the "
                                  f"tied module has not as a parameter")
            group.broadcast(params[name].data, src=0)

    # -- DeepSpeed's queries -----------------------------------------------------------
    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        """The stage holding layer ``layer_idx``."""
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise IndexError(f"layer {layer_idx} of {len(self._layer_specs)}")

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def checkpoint_layers(self) -> list[tuple[str | None, bool, tuple[str, ...]]]:
        """What DeepSpeed's pipeline save writes of each layer, the whole list's: (its
        parameters' name prefix -- ``"3"``, ``"tied_modules.<key>"``, None for a
        function; whether it has a ``layer_II-model_states.pt``, which a tied occurrence
        used through ``forward_fn`` has not; a tied layer's tied attributes). What
        :mod:`hybrid.checkpoint.peers.deepspeed_pipe` names the files' entries by."""
        out: list[tuple[str | None, bool, tuple[str, ...]]] = []
        for idx, spec in enumerate(self._layer_specs):
            if isinstance(spec, TiedLayerSpec):
                out.append((f"tied_modules.{spec.key}", spec.forward_fn is None,
                            tuple(spec.tied_weight_attr)))
            elif isinstance(spec, (LayerSpec, nn.Module)):
                out.append((str(idx), True, ()))
            else:
                out.append((None, False, ()))
        return out

    # -- the stage's forward -------------------------------------------------------------
    def _checkpointable(self, funcs: Sequence[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters())
                   for f in funcs)

    def forward(self, x: object) -> object:
        """This stage's layers in order on ``x`` (what the stage before sent, or the
        micro-batch's inputs on the first stage); with an interval k, blocks of k
        layers are recomputed in backward (class doc)."""
        funcs = self.forward_funcs
        k = self.activation_checkpoint_interval
        if k == 0:
            return _run(funcs, x)
        for start in range(0, len(funcs), k):
            block = funcs[start:start + k]
            args = x if isinstance(x, tuple) else (x,)
            if self._checkpointable(block):
                x = self.activation_checkpoint_func(_Block(block), *args)
            else:
                x = _Block(block)(*args)
        return x


def _run(funcs: Sequence[Callable], x: object) -> object:
    for f in funcs:
        x = f(x)
    return x


class _Bound:
    """A tied occurrence's ``forward_fn(module, x)`` bound to the shared module."""

    def __init__(self, fn: Callable, module: nn.Module):
        self.fn, self.module = fn, module

    def __call__(self, x: object) -> object:
        return self.fn(self.module, x)


class _Block:
    """A run of layers as one function of unpacked inputs (one input: the tensor)."""

    def __init__(self, funcs: Sequence[Callable]):
        self.funcs = list(funcs)

    def __call__(self, *inputs: object) -> object:
        return _run(self.funcs, inputs[0] if len(inputs) == 1 else inputs)
