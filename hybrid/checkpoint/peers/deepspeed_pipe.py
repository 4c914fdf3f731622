"""DeepSpeed pipeline checkpoints (a ``PipelineModule`` trained by DeepSpeed's
``PipelineEngine``, as Megatron-DeepSpeed's GPT is), read with their optimizer state into
the names of :class:`hybrid.deepspeed.pipe.PipelineModule`.

[Note: DeepSpeed's pipeline files, as 0.19.8 writes them]
A pipeline save's tag directory holds, for ``S`` stages and DP size ``D``:

* ``layer_II-model_states.pt`` per layer index II (two digits, the whole model's
  numbering): the layer's own ``state_dict()`` (``{"weight": ..., "bias": ...}``),
  written by the stage holding it (DP rank 0). A layer without ``state_dict`` (a
  function, a ``TiedLayerSpec`` used through its ``forward_fn``) has no file; a module
  without parameters (``nn.Tanh``) an empty one. A tied layer's file holds the tied
  module's state dict, under the layer's index. With a ``model`` (tensor-parallel) axis
  the names carry ``-model_MM`` before ``-model_states.pt``.
* ``mp_rank_SS_model_states.pt`` per stage: DeepSpeed's "model-parallel rank" of a
  pipeline is the rank's index in its replica (all stages of one DP index), so SS is the
  stage (at TP 1). ``module`` is None (the weights are in the layer files); it holds the
  counters, ``lr_scheduler``, ``buffer_names`` (the stage's), ``mp_world_size`` (S),
  ``checkpoint_parallel_dimensions`` (``pp_degree``, ``tp_degree``), ``ds_config``; and
  per stage either
  - without ZeRO: ``optimizer``, the stage's torch optimizer's state dict, its i-th
    parameter the stage module's i-th (``tied_modules`` first, in the order their keys
    first occur on the stage, then the layers in order); or
  - ZeRO 1 (DeepSpeed's pipeline engine refuses 2 and 3): ``param_shapes``, the stage's
    parameters by the module's names (``tied_modules.<key>.<attr>``, ``<idx>.<param>``),
    and ``zero_pp_rank_R_mp_rank_SS_optim_states.pt`` per DP rank R of stage SS: the
    stage's flat partitions, laid out as a data-parallel ZeRO 1 save's
    (:mod:`.deepspeed_files`); or
  - bf16 without ZeRO (Megatron-DeepSpeed's, BLOOM's): BF16_Optimizer's
    ``bf16_zero_pp_rank_R_mp_rank_SS_optim_states.pt``, laid out as ZeRO 1's, with
    ``param_shapes`` None: the names and their order are the files'
    ``param_slice_mappings``, the shapes the layer files' (:mod:`.deepspeed_bf16`'s Note);
    the layer files hold the bf16 weights, the masters are the partitions.

A tied weight is held, and its optimizer state kept, by every stage using it (equal:
the copies step from the summed gradient); the first such stage's is read.

What names each layer file's entries is the loading module (:func:`layer_prefixes`, from
its ``checkpoint_layers()``: which index is a plain layer, which a tied key's
occurrence, which a function), so this
reader serves ``engine.load_checkpoint`` on hybrid's ``PipelineModule`` only. Refused, by
name: a ``model`` axis (tensor-parallel pipeline checkpoints), buffers and frozen
parameters (hybrid's pipeline engine checkpoints neither), fp16 without ZeRO, a tied
module spanning stages
with parameters beyond its tied ones (each stage's own; hybrid keeps one), a missing
layer or optimizer file, a layer list that is not the module's.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybrid.checkpoint.peers import deepspeed as ds, deepspeed_bf16 as bf16
from hybrid.checkpoint.peers.deepspeed_files import (
    FORMAT,
    MODEL_FILE,
    OPTIM_FILE,
    load_file,
    need,
)
from hybrid.errors import CheckpointError

LAYER_FILE = re.compile(r"^layer_(\d+)-(?:(.+)-)?model_states\.pt$")
COLUMNS = ds.COLUMNS


@dataclass(frozen=True)
class Layer:
    """One entry of a PipelineModule's layer list, as its checkpoint sees it: ``prefix``,
    its parameters' name prefix (``"3"``, ``"tied_modules.embed"``; None for a function);
    ``saved``: whether DeepSpeed writes its ``layer_II`` file; ``tied``: the tied
    attributes of a ``TiedLayerSpec`` (empty otherwise)."""
    prefix: str | None
    saved: bool
    tied: tuple[str, ...] = ()


def layer_prefixes(module) -> list[Layer]:
    """The :class:`Layer` of each of a PipelineModule's layers (hybrid.deepspeed.pipe's
    ``checkpoint_layers``)."""
    return [Layer(prefix, saved, tuple(tied)) for prefix, saved, tied in
            module.checkpoint_layers()]


def is_pipeline(tag_dir: str) -> bool:
    """Whether the tag directory holds a pipeline save's layer files."""
    return any(LAYER_FILE.match(n) for n in os.listdir(tag_dir))


def tag_dir_of(path: str, step: int | None = None) -> str | None:
    """The tag directory of a DeepSpeed save directory (``latest``'s, or
    ``global_step<step>``), or ``path`` itself when it is one; None when neither."""
    return ds._tag_dir(path, step)


class _StageZero(ds.DeepSpeedCheckpoint):
    """One stage's ZeRO 1 partitions (its ``zero_pp_rank_*_mp_rank_SS`` files), read as
    the data-parallel reader reads a whole model's."""

    def __init__(self, tag_dir: str, model_file: str, ms: dict, optim_paths: list[str],
                 stage: int, groups: list[dict[str, list[int]]] | None = None):
        self.path, self.model_file, self.notes = tag_dir, model_file, []
        if groups is None:
            self._shapes_from(ms)
        else:  # (BF16_Optimizer without ZeRO: no param_shapes; the slice mappings' names)
            self._groups, self.ds_shapes = groups, {k: v for g in groups for k, v in g.items()}
        self.world, self._optim_paths, self._open = len(optim_paths), optim_paths, {}
        self.stage, self.format = stage, f"{FORMAT} ZeRO {stage}"


class DeepSpeedPipeline:
    """One tag of a DeepSpeed pipeline checkpoint (the module Note), as a
    :class:`~hybrid.checkpoint.peers.base.PeerCheckpoint` in the loading PipelineModule's
    names; ``layers``: its :func:`layer_prefixes`."""

    def __init__(self, tag_dir: str, layers: Sequence[Layer],
                 first_copy: frozenset[str] = frozenset()):
        self.path, self.layers = tag_dir, list(layers)
        # (a tied module's parameters that only its first stage's forward uses, as
        # GPTModelPipe's position embeddings: read from that stage, the others' copies
        # untrained and ignored)
        self.first_copy = first_copy
        self.notes = ["RNG state: DeepSpeed saves none; the run's generators start from "
                      "its seed"]
        self.flags: dict = {}
        self.vocab_size = None
        self.frozen_shapes: dict[str, list[int]] = {}
        self.excludes_frozen = False
        self._layer_files = self._find_layer_files(tag_dir)
        self._loaded: dict[int, dict] = {}
        models = ds._files(tag_dir, MODEL_FILE)
        stages = len(models)
        if sorted(models) != [(0, s) for s in range(stages)]:
            there = ", ".join(sorted(os.path.basename(p) for p in models.values()))
            raise CheckpointError(f"{tag_dir}: a {FORMAT} pipeline checkpoint needs "
                                  f"mp_rank_00..{stages - 1:02d}_model_states.pt, one per "
                                  f"stage; there: {there}")
        self.model_files = [models[(0, s)] for s in range(stages)]
        self.model_file = self.model_files[0]
        self._states = [self._stage_header(s, p) for s, p in enumerate(self.model_files)]
        ms = self._states[0]
        self.iteration = int(need(ms, "global_steps", self.model_file))
        for path, other in zip(self.model_files[1:], self._states[1:]):
            if other.get("global_steps") != self.iteration:
                raise CheckpointError(f"{path}: global_steps {other.get('global_steps')}, "
                                      f"stage 0's {self.iteration} (files of two saves mixed)")
        self.consumed_samples = int(ms.get("global_samples") or 0)
        zero = (ms.get("ds_config") or {}).get("zero_optimization")
        self.zero = int(zero.get("stage", 0) if isinstance(zero, dict) else bool(zero))
        self.format = f"{FORMAT} pipeline ZeRO {self.zero} (PP {stages})"
        self.dp = int(ms.get("dp_world_size") or 1)
        self._entries = [self._layer_entries(i) for i in range(len(self.layers))]
        # bf16 without ZeRO: DeepSpeed's PipelineEngine trains with BF16_Optimizer, whose
        # bf16_zero_pp_rank_* files hold flat partitions as ZeRO 1's (deepspeed_bf16's Note)
        self._bf16_run = bool(bf16.bf16_enabled(ms.get("ds_config")))
        self.bf16 = self.zero == 0 and self._bf16_run
        self._bf16_groups: list[list[dict[str, list[int]]]] = []
        if self.bf16:
            self.format = f"{FORMAT} pipeline bf16 BF16_Optimizer (PP {stages})"
            self._stage_names = [self._bf16_stage(s) for s in range(stages)]
            self.notes.append("bf16: the fp32 masters are BF16_Optimizer's partitions (the "
                              "layer files' bf16 weights are their rounding)")
        if self.zero == 1 or self.bf16:
            if not self.bf16:
                self._stage_names = [self._zero1_stage(s) for s in range(stages)]
            trained = {n for names in self._stage_names for n in names}
            for idx, entries in enumerate(self._entries):
                frozen = [n for n in entries or {} if n not in trained]
                if frozen:
                    where = "param_slice_mappings" if self.bf16 else "param_shapes"
                    raise CheckpointError(f"{self._layer_file(idx)}: {frozen[0]} is in no "
                                          f"stage's {where}: a frozen parameter; "
                                          f"hybrid's pipeline engine trains every parameter")
        elif self.zero == 0:
            self._stage_names = self._partition_zero0()
        else:
            raise CheckpointError(f"{self.model_file}: ZeRO stage {self.zero} in a pipeline "
                                  f"checkpoint: DeepSpeed's pipeline engine trains at ZeRO "
                                  f"0 and 1 only (files of another kind mixed in?)")
        self.shapes: dict[str, list[int]] = {}
        for names in self._stage_names:  # (a tied weight: on several stages, one name)
            for n, shape in names.items():
                self.shapes.setdefault(n, list(shape))
        self._check_tied()

    # -- the files ----------------------------------------------------------------------
    def _find_layer_files(self, tag_dir: str) -> dict[int, str]:
        out: dict[int, str] = {}
        for name in sorted(os.listdir(tag_dir)):
            m = LAYER_FILE.match(name)
            if not m:
                continue
            if m.group(2) is not None:
                raise CheckpointError(f"{os.path.join(tag_dir, name)}: a {FORMAT} pipeline "
                                      f"checkpoint with a model (tensor-parallel) axis "
                                      f"({m.group(2)}): hybrid reads DeepSpeed pipeline "
                                      f"checkpoints of tensor-parallel size 1")
            out[int(m.group(1))] = os.path.join(tag_dir, name)
        extra = [i for i in out if i >= len(self.layers) or self.layers[i].prefix is None]
        if extra:
            raise CheckpointError(f"{out[extra[0]]}: a layer file for layer {extra[0]}, "
                                  f"which the PipelineModule loading it has "
                                  f"{'not' if extra[0] >= len(self.layers) else 'as a function'}"
                                  f" ({len(self.layers)} layers): a checkpoint of "
                                  f"another model")
        return out

    def _stage_header(self, stage: int, path: str) -> dict:
        ms = load_file(path)
        version = str(ms.get("ds_version", ""))
        if not version.startswith("0."):
            raise CheckpointError(f"{path}: ds_version {version or 'missing'}: hybrid reads "
                                  f"checkpoints of DeepSpeed 0.x (tested: 0.19.8)")
        dims = ms.get("checkpoint_parallel_dimensions") or {}
        if int(dims.get("tp_degree") or 1) != 1:
            raise CheckpointError(f"{path}: a {FORMAT} pipeline checkpoint with a model "
                                  f"(tensor-parallel) axis (tp_degree {dims['tp_degree']}): "
                                  f"hybrid reads DeepSpeed pipeline checkpoints of "
                                  f"tensor-parallel size 1")
        stages = len(self.model_files)
        world = int(ms.get("mp_world_size") or 1)
        pp = int(dims.get("pp_degree") or world)
        if world != stages or pp != stages:
            raise CheckpointError(f"{path}: mp_world_size {world} (pp_degree {pp}), but "
                                  f"{stages} stages' mp_rank_*_model_states.pt are there (an "
                                  f"incomplete or mixed save)")
        buffers = list(ms.get("buffer_names") or ())
        if buffers:
            raise CheckpointError(f"{path}: buffers ({', '.join(buffers[:4])}) on pipeline "
                                  f"stage {stage}: hybrid's pipeline engine checkpoints no "
                                  f"buffers (each stage would keep its own)")
        return ms

    def _layer_file(self, idx: int) -> str:
        path = self._layer_files.get(idx)
        if path is None:
            raise CheckpointError(f"{os.path.join(self.path, f'layer_{idx:02d}-model_states.pt')}"
                                  f": missing: layer {idx} ({self.layers[idx].prefix}) of "
                                  f"the {FORMAT} pipeline checkpoint (an incomplete save, or "
                                  f"a checkpoint of another model)")
        return path

    def _layer_state(self, idx: int) -> dict:
        if idx not in self._loaded:  # (memory-mapped: read when a value is)
            self._loaded[idx] = load_file(self._layer_file(idx))
        return self._loaded[idx]

    def _layer_entries(self, idx: int) -> dict[str, list[int]] | None:
        """Layer ``idx``'s parameters (the module's names -> shapes) from its file; None
        for a layer without one (a function, a tied occurrence through ``forward_fn``)."""
        layer = self.layers[idx]
        if not layer.saved or layer.prefix is None:
            return None
        state = self._layer_state(idx)
        out = {}
        for k, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{self._layer_file(idx)}: {k} is a "
                                      f"{type(t).__name__}, not a tensor")
            out[f"{layer.prefix}.{k}"] = list(t.shape)
        return out

    def _tied_entries(self, prefix: str) -> dict[str, list[int]]:
        """A tied module's parameters: from the first of its occurrences' files."""
        for idx, layer in enumerate(self.layers):
            if layer.prefix == prefix and self._entries[idx] is not None:
                return self._entries[idx]  # type: ignore[return-value]
        first = next(i for i, layer in enumerate(self.layers) if layer.prefix == prefix)
        raise CheckpointError(f"{os.path.join(self.path, f'layer_{first:02d}-model_states.pt')}"
                              f": no layer file holds the tied module {prefix} (every "
                              f"occurrence uses it through forward_fn, which DeepSpeed does "
                              f"not save): its weights are not in the checkpoint")

    # -- which stage holds which parameters ---------------------------------------------
    def _zero1_stage(self, s: int) -> dict[str, list[int]]:
        ms, path = self._states[s], self.model_files[s]
        groups = need(ms, "param_shapes", path)
        names = {k: [int(d) for d in v] for g in groups for k, v in g.items()}
        for idx, entries in enumerate(self._entries):
            for n, shape in (entries or {}).items():
                if n in names and names[n] != shape:
                    raise CheckpointError(f"{self._layer_file(idx)}: {n} is {shape}, "
                                          f"param_shapes of {os.path.basename(path)} says "
                                          f"{names[n]} (files of two saves mixed)")
        known = {n for e in self._entries for n in (e or {})}
        unsaved = [n for n in names if n not in known]
        if unsaved:
            raise CheckpointError(f"{path}: stage {s} trains {unsaved[0]}, which no layer "
                                  f"file of the PipelineModule loading it holds (a checkpoint "
                                  f"of another model, or a missing layer file)")
        return names

    def _optim_paths(self, s: int) -> list[str]:
        """Stage ``s``'s optimizer files, one per DP rank (one CheckpointError naming a
        missing one)."""
        optims = ds._files(self.path, OPTIM_FILE)
        prefix = "bf16_" if self._bf16_run else ""
        paths = []
        for r in range(self.dp):
            if (r, s) not in optims:
                name = f"{prefix}zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt"
                raise CheckpointError(
                    f"{os.path.join(self.path, name)}: missing: stage {s}'s optimizer "
                    f"partition of DP rank {r} (dp_world_size {self.dp}; an incomplete save)")
            paths.append(optims[(r, s)])
        return paths

    def _bf16_stage(self, s: int) -> dict[str, list[int]]:
        """Stage ``s``'s parameters under BF16_Optimizer: the names of its ranks'
        ``param_slice_mappings`` (:func:`.deepspeed_bf16.slice_names`), the shapes the
        layer files'."""
        paths = self._optim_paths(s)
        optims = [need(load_file(p), "optimizer_state_dict", p) for p in paths]
        known = {n: shape for e in self._entries for n, shape in (e or {}).items()}
        groups = []
        for names in bf16.slice_names(optims, paths):
            unsaved = [n for n in names if n not in known]
            if unsaved:
                raise CheckpointError(f"{paths[0]}: stage {s} trains {unsaved[0]}, which no "
                                      f"layer file of the PipelineModule loading it holds (a "
                                      f"checkpoint of another model, or a missing layer file)")
            groups.append({n: known[n] for n in names})
        self._bf16_groups.append(groups)
        return {n: shape for g in groups for n, shape in g.items()}

    def _stage_params(self, lo: int, hi: int) -> dict[str, list[int]]:
        """The parameters of a stage holding layers ``[lo, hi)``, in its module's order:
        its tied modules' (keys by first occurrence), then its layers'."""
        out: dict[str, list[int]] = {}
        tied = [layer.prefix for layer in self.layers[lo:hi]
                if layer.prefix is not None and layer.prefix.startswith("tied_modules.")]
        for prefix in dict.fromkeys(tied):
            out.update(self._tied_entries(prefix))
        for idx in range(lo, hi):
            if self.layers[idx].prefix == str(idx):
                out.update(self._entries[idx] or {})
        return out

    def _optimizer(self, s: int) -> tuple[list[int], dict]:
        """Stage ``s``'s torch optimizer: its parameter indices in order, its state."""
        path = self.model_files[s]
        osd = self._states[s].get("optimizer")
        if osd is None:
            raise CheckpointError(f"{path}: no optimizer state (saved without it); hybrid "
                                  f"imports a {FORMAT} checkpoint to continue its training")
        if not isinstance(osd, dict) or set(osd) != {"state", "param_groups"}:
            raise CheckpointError(f"{path}: the optimizer state is not a torch optimizer's: "
                                  f"DeepSpeed's fp16 optimizer without ZeRO; hybrid "
                                  f"reads fp32 and bf16 pipeline checkpoints without ZeRO")
        return [int(i) for g in osd["param_groups"] for i in g["params"]], osd["state"]

    def _fits(self, s: int, params: dict[str, list[int]]) -> bool:
        order, state = self._optimizer(s)
        if len(order) != len(params):
            return False
        for i, shape in zip(order, params.values()):
            got = (state.get(i) or {}).get("exp_avg")
            if got is not None and list(got.shape) != shape:
                return False
        return True

    def _partition_zero0(self) -> list[dict[str, list[int]]]:
        """Without ZeRO no file names a stage's parameters: the stages' layer runs are the
        contiguous cut whose every stage's parameters match its optimizer's, in count
        and shapes (the layers a cut may move, parameterless ones and repeated tied
        occurrences, change no stage's parameters)."""
        n, stages = len(self.layers), len(self.model_files)

        @functools.cache
        def cut(s: int, lo: int) -> tuple[int, ...] | None:
            if s == stages:
                return () if lo == n else None
            for hi in range(lo + 1, n - (stages - s - 1) + 1):
                if self._fits(s, self._stage_params(lo, hi)):
                    rest = cut(s + 1, hi)
                    if rest is not None:
                        return (hi, *rest)
            return None
        ends = cut(0, 0)
        if ends is None:
            counts = [len(self._optimizer(s)[0]) for s in range(stages)]
            raise CheckpointError(f"{self.path}: no cut of the PipelineModule's "
                                  f"{n} layers into {stages} stages gives each stage the "
                                  f"parameters its optimizer holds ({counts} in "
                                  f"mp_rank_*_model_states.pt): a checkpoint of another "
                                  f"model, frozen parameters, or an optimizer over other "
                                  f"parameter groups")
        bounds = [0, *ends]
        self.partition = bounds
        return [self._stage_params(a, b) for a, b in zip(bounds, bounds[1:])]

    def _check_tied(self) -> None:
        """A tied module on several stages: only its tied attributes may be parameters
        (hybrid's checkpoint holds one value of each name)."""
        for layer in self.layers:
            if not layer.tied or layer.prefix is None:
                continue
            holders = [s for s, names in enumerate(self._stage_names)
                       if any(n.startswith(layer.prefix + ".") for n in names)]
            own = [n for n in self.shapes if n.startswith(layer.prefix + ".")
                   and n[len(layer.prefix) + 1:] not in layer.tied
                   and n not in self.first_copy]
            if len(holders) > 1 and own:
                raise CheckpointError(f"{self.model_files[holders[1]]}: {own[0]} of the tied "
                                      f"module on stages {holders} is not one of its tied "
                                      f"attributes ({', '.join(layer.tied)}): each stage "
                                      f"trains its own, and hybrid's checkpoint keeps one")

    # -- the values -------------------------------------------------------------------------
    @functools.cached_property
    def _zero_stages(self) -> list[_StageZero]:
        return [_StageZero(self.path, path, self._states[s], self._optim_paths(s), 1,
                           self._bf16_groups[s] if self.bf16 else None)
                for s, path in enumerate(self.model_files)]

    @functools.cached_property
    def columns(self) -> tuple[str, ...]:
        if self.zero == 1 or self.bf16:
            return self._zero_stages[0].columns
        return COLUMNS if self._optimizer(0)[1] else COLUMNS[:1]

    @functools.cached_property
    def step(self) -> int:
        if self.zero == 1 or self.bf16:
            return self._zero_stages[0].step
        state = self._optimizer(0)[1]
        if not state:
            return 0
        step = next(iter(state.values())).get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    def _master(self, name: str) -> torch.Tensor:
        """A parameter's value from its layer file (the first occurrence's for a tied one)."""
        for idx, layer in enumerate(self.layers):
            if layer.prefix is not None and name in (self._entries[idx] or {}):
                return self._layer_state(idx)[name[len(layer.prefix) + 1:]].float().clone()
        raise CheckpointError(f"{self.path}: no layer file holds {name}")

    def read(self, name: str) -> dict[str, torch.Tensor]:
        """The first stage's values of ``name``; a tied weight's, checked equal to every
        other stage's copy (they step alike: a difference is two saves' files mixed)."""
        holders = [s for s, names in enumerate(self._stage_names) if name in names]
        if name in self.first_copy:
            holders = holders[:1]
        out = self._read_stage(name, holders[0])
        for s in holders[1:]:
            other = self._read_stage(name, s)
            for k, v in out.items():
                if not torch.equal(v, other[k]):
                    raise CheckpointError(
                        f"{self.model_files[s]}: the {k} of the tied {name} on stage {s} "
                        f"differs from stage {holders[0]}'s (its copies step alike: files "
                        f"of two saves mixed)")
        return out

    def _read_stage(self, name: str, s: int) -> dict[str, torch.Tensor]:
        if self.zero == 1 or self.bf16:
            return self._zero_stages[s].read_ds(name)
        out = {"master": self._master(name)}
        if len(self.columns) > 1:
            order, state = self._optimizer(s)
            i = order[list(self._stage_names[s]).index(name)]
            st = state.get(i)
            if not st:
                raise CheckpointError(f"{self.model_files[s]}: no optimizer state for "
                                      f"{name} (it never had a gradient)")
            out.update({k: st[k].float().clone().view(out["master"].shape)
                        for k in COLUMNS[1:]})
        return out

    def untrained(self) -> dict[str, torch.Tensor]:
        return {}  # (buffers and frozen parameters are refused above)

    def configure(self, config: dict) -> None:
        pass  # (the checkpoint records every shape it needs)

    def close(self) -> None:
        if "_zero_stages" in self.__dict__:
            for stage in self._zero_stages:
                stage.close()
        self._loaded.clear()


def open(path: str, layers: Sequence[Layer], step: int | None = None  # noqa: A001
         ) -> DeepSpeedPipeline:
    """The DeepSpeed pipeline checkpoint under ``path`` (a save directory, or a tag's),
    in the names of the PipelineModule whose :func:`layer_prefixes` are ``layers``."""
    tag_dir = tag_dir_of(path, step)
    if tag_dir is None:
        raise CheckpointError(f"{path}: no {FORMAT} checkpoint")
    return DeepSpeedPipeline(tag_dir, layers)


__all__ = ["DeepSpeedPipeline", "Layer", "is_pipeline", "layer_prefixes", "open"]
