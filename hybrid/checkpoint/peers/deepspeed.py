"""DeepSpeed checkpoints (``engine.save_checkpoint``'s ``global_stepN/``: ZeRO 1-3, stage 0
(:class:`DeepSpeedZero0`) and the universal format), read with their optimizer state, and
written back (:func:`write`). The files: :mod:`.deepspeed_files` (its Note). What comes
over: the fp32 masters, both Adam moments and the step count, the engine's ``global_steps``
(the iteration) and ``global_samples`` (consumed samples), and the scheduler's state
(:func:`engine_state`, for the ``load_checkpoint`` door). DeepSpeed saves no RNG state (a
line in ``notes``); nor does it save the data position beyond ``global_samples``.
"""

from __future__ import annotations

import builtins
import functools
import glob
import math
import os
import re
from collections.abc import Collection

import torch

from hybrid.checkpoint.peers import deepspeed_bf16 as bf16
from hybrid.checkpoint.peers.deepspeed_files import (
    FORMAT,
    LATEST,
    MODEL_FILE,
    OPTIM_FILE,
    Layout,
    layout_3,
    layout_12,
    load_file,
    need,
)
from hybrid.checkpoint.peers.deepspeed_names import NameMap, hf_names
from hybrid.errors import CheckpointError

COLUMNS = ("master", "exp_avg", "exp_avg_sq")

# -- where the files are -------------------------------------------------------------------


def _tag_dir(path: str, step: int | None) -> str | None:
    """The tag's directory ``path`` means (it, when it holds model-state files; else
    the one ``latest`` names, or ``global_step<step>``); None when neither."""
    if step is not None:
        d = os.path.join(path, f"global_step{step}")
        return d if os.path.isdir(d) else None
    if glob.glob(os.path.join(glob.escape(path), "*mp_rank_*_model_states.pt")):
        return path
    for name in (LATEST, LATEST + "_universal"):  # (ds_to_universal's, where it alone is)
        latest = os.path.join(path, name)
        if not os.path.isfile(latest) or os.path.getsize(latest) >= 4096:
            continue
        with builtins.open(latest, encoding="utf-8", errors="replace") as f:
            tag = f.read().strip()
        d = os.path.join(path, tag)
        if tag and os.sep not in tag and glob.glob(
                os.path.join(glob.escape(d), "*mp_rank_*_model_states.pt")):
            return d
    return None


def detect(path: str) -> bool:
    """Whether ``path`` is a DeepSpeed save directory (``latest`` naming a tag that holds
    model-state files) or one tag's directory. A few globs and one tiny file read."""
    return os.path.isdir(path) and _tag_dir(path, None) is not None


def _files(tag_dir: str, pattern: re.Pattern) -> dict[tuple[int, int], str]:
    """(dp rank, mp rank) -> path of the files ``pattern`` matches in ``tag_dir``."""
    out = {}
    for name in sorted(os.listdir(tag_dir)):
        m = pattern.match(name)
        if m:
            out[(int(m.group(1) or 0), int(m.group(2)))] = os.path.join(tag_dir, name)
    return out


# -- the checkpoint --------------------------------------------------------------------------

class DeepSpeedCheckpoint:
    """One tag of a DeepSpeed ZeRO checkpoint (:mod:`.deepspeed_files`' Note), as a
    :class:`~hybrid.checkpoint.peers.base.PeerCheckpoint`. ``shapes``: the model's
    parameters by DeepSpeed's names (its module's own), unless ``names`` maps them."""

    def __init__(self, tag_dir: str, names=None):
        ms = self._header(tag_dir)
        zero = (ms.get("ds_config") or {}).get("zero_optimization")
        stage = (zero.get("stage") if isinstance(zero, dict)
                 else None if zero is None else int(bool(zero)))
        prefix = bf16.optim_prefix(tag_dir, ms.get("ds_config"), self.model_file)
        optims = _files(tag_dir, OPTIM_FILE)
        self._shapes_from(ms)
        world = int(ms.get("dp_world_size") or len(optims))
        if sorted(optims) != [(r, 0) for r in range(world)]:
            have = ", ".join(os.path.basename(p) for p in optims.values()) or "none"
            raise CheckpointError(f"{tag_dir}: {FORMAT} dp_world_size {world} (in "
                                  f"{os.path.basename(self.model_file)}) needs "
                                  f"{prefix}zero_pp_rank_0..{world - 1}_mp_rank_00_"
                                  f"optim_states.pt; "
                                  f"there: {have} (an incomplete or mixed save)")
        self.world = world
        self._optim_paths = [optims[(r, 0)] for r in range(world)]
        self._open: dict[int, dict] = {}
        # the stage: the ds_config's, else the optimizer file's (read when first needed)
        self.stage: int | None = None if stage is None else int(stage)
        self.format = f"{FORMAT} ZeRO" + ("" if stage is None else f" {stage}")
        self._bind(ms, names)

    def _header(self, tag_dir: str) -> dict:
        """Read the model-state file: the counters, ``param_shapes``; returns its dict."""
        self.path = tag_dir
        self.notes: list[str] = []
        models = _files(tag_dir, MODEL_FILE)
        if not models:
            raise CheckpointError(f"{tag_dir}: no *mp_rank_*_model_states.pt: not a {FORMAT} "
                                  f"checkpoint")
        layers = glob.glob(os.path.join(glob.escape(tag_dir), "layer_*-model_states.pt"))
        if layers:  # (hybrid.checkpoint.peers.deepspeed_pipe reads them, into the module)
            raise CheckpointError(f"{sorted(layers)[0]}: a {FORMAT} pipeline (PipelineModule) "
                                  f"checkpoint: hybrid reads it with engine.load_checkpoint "
                                  f"on hybrid.deepspeed's PipelineModule built from the same "
                                  f"layers (its layer list names the files' entries)")
        if any(mp for _, mp in models):
            raise CheckpointError(f"{sorted(models.values())[-1]}: a {FORMAT} checkpoint with "
                                  f"model parallelism (mp_rank > 0): hybrid reads DeepSpeed's "
                                  f"data-parallel ZeRO checkpoints (mp_world_size 1)")
        self.model_file = models[min(models)]
        ms = load_file(self.model_file)
        self.model_state = {k: ms.get(k) for k in (
            "global_steps", "global_samples", "lr_scheduler", "skipped_steps", "ds_version",
            "dp_world_size", "mp_world_size", "ds_config")}
        version = str(ms.get("ds_version", ""))
        if not version.startswith("0."):
            raise CheckpointError(f"{self.model_file}: ds_version {version or 'missing'}: "
                                  f"hybrid reads checkpoints of DeepSpeed 0.x (tested: 0.19.8)")
        self._model_states = ms  # (mapped: the module's frozen values and buffers, if asked)
        if int(ms.get("mp_world_size") or 1) != 1:
            raise CheckpointError(f"{self.model_file}: mp_world_size "
                                  f"{ms['mp_world_size']}: hybrid reads DeepSpeed checkpoints "
                                  f"of mp_world_size 1")
        self.iteration = int(need(ms, "global_steps", self.model_file))
        self.consumed_samples = int(ms.get("global_samples") or 0)
        return ms

    def _shapes_from(self, ms: dict) -> None:
        """The parameters' shapes by name, from ZeRO's ``param_shapes`` (a dict per
        optimizer group, in the flat partitions' order)."""
        shapes = need(ms, "param_shapes", self.model_file)
        if not isinstance(shapes, (list, tuple)):  # (None: a save without ZeRO's, mixed in)
            raise CheckpointError(f"{self.model_file}: param_shapes {shapes!r} (a save without "
                                  f"ZeRO) beside ZeRO's files: files of two saves mixed")
        self._groups = [{k: [int(d) for d in v] for k, v in g.items()} for g in shapes]
        self.ds_shapes = {k: v for g in self._groups for k, v in g.items()}

    def _bind(self, ms: dict, names) -> None:
        """The names hybrid reads the parameters by (the Note on whose names), and the
        frozen parameters (``frozen_shapes``: only a module read by its own names has
        any; the GPT routes refuse them by name)."""
        self.frozen_shapes = self._frozen(ms)
        self.excludes_frozen = False  # (a module that froze more says so: take_excluded)
        if self.frozen_shapes and names != "module":
            raise CheckpointError(f"{self.model_file}: frozen parameters "
                                  f"({', '.join(list(self.frozen_shapes)[:4])}): hybrid's GPT "
                                  f"trains every parameter; load it with engine.load_checkpoint "
                                  f"on the module that froze them")
        self._own_names = names == "module"
        self.notes.append("RNG state: DeepSpeed saves none; the run's generators start from "
                          "its seed")
        if names != "module":  # the --load route: hybrid's schedule, from the run's flags
            self.notes.append(f"learning-rate schedule: hybrid's, from the run's flags at "
                              f"iteration {self.iteration}; DeepSpeed's lr_scheduler state "
                              f"({ms.get('lr_scheduler')}) is not read")
        if names is None:
            names = hf_names(self.path, self.ds_shapes)
        if names is None or names == "module":
            names = NameMap({k: k for k in self.ds_shapes}, dict(self.ds_shapes))
        self.names: NameMap = names
        self.shapes = dict(names.shapes)
        self.flags = dict(names.flags)
        self.vocab_size = names.vocab_size

    # -- what needs an optimizer file: read when first asked (a restart that finds its
    # import done asks for none of it)
    @functools.cached_property
    def layout(self) -> Layout:
        first, path = self._optim(0), self._optim_paths[0]
        if bf16.is_bf16_optimizer(first):  # (read as ZeRO 1's; the format keeps its stage)
            layout = bf16.bf16_layout(self._groups, self.world, first, path, self.stage,
                                      self.model_file)
            self.stage = 1
            self.__dict__["layout"] = layout
            self._check_slice_mappings(0)
            return layout
        stage = int(need(first, "zero_stage", path))
        if self.stage is None:
            self.stage, self.format = stage, f"{FORMAT} ZeRO {stage}"
        if stage != self.stage:
            raise CheckpointError(f"{path}: zero_stage {stage}, but the ds_config in "
                                  f"{os.path.basename(self.model_file)} says {self.stage} "
                                  f"(files of two saves mixed)")
        try:
            if stage in (1, 2):
                fp32 = need(first, "single_partition_of_fp32_groups", path)
                pads = need(first, "group_paddings", path)
                part = [int(t.numel()) + int(p) for t, p in zip(fp32, pads)]
                layout = layout_12(self._groups, self.world, part,
                                    first.get("param_alignment_paddings"))
            elif stage == 3:
                sub = [int(t.numel()) for t in need(first, "fp32_flat_groups", path)]
                layout = layout_3(self._groups, self.world, sub)
            else:
                raise CheckpointError(f"{path}: zero_stage {stage}: hybrid reads DeepSpeed's "
                                      f"ZeRO 1-3 optimizer files")
        except ValueError as e:
            raise CheckpointError(f"{path}: its partitions do not match param_shapes of "
                                  f"{os.path.basename(self.model_file)}: {e}") from None
        self.__dict__["layout"] = layout
        if stage in (1, 2):
            self._check_slice_mappings(0)
        return layout

    @functools.cached_property
    def columns(self) -> tuple[str, ...]:
        self.layout  # noqa: B018 (the stage checked first)
        return COLUMNS if self._base_state(0).get("state") else COLUMNS[:1]

    @functools.cached_property
    def loss_scaler(self) -> dict | None:  # (fp16's, as hybrid's: .deepspeed_bf16's)
        held, path = self._optim(0).get("loss_scaler"), self._optim_paths[0]
        return bf16.loss_scaler_state(held, self.model_state["ds_config"], path, self.notes)

    @functools.cached_property
    def step(self) -> int:
        self.layout  # noqa: B018 (the stage known first)
        state = self._base_state(0).get("state") or {}
        if not state:
            return 0
        step = next(iter(state.values())).get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    # -- files
    def _optim(self, rank: int) -> dict:
        if rank not in self._open:
            path = self._optim_paths[rank]
            self._open[rank] = need(load_file(path), "optimizer_state_dict", path)
            if rank:
                bf16.check_same_save(self._open[rank], path, self._optim(0),
                                     self._optim_paths[0])
        return self._open[rank]

    def _base_state(self, rank: int) -> dict:
        o = self._optim(rank)
        key = "base_optimizer_state" if self.stage in (1, 2) else "optimizer_state_dict"
        return need(o, key, self._optim_paths[rank])

    def _check_slice_mappings(self, rank: int) -> None:
        """The parameters' places DeepSpeed recorded for ``rank`` equal the computed ones."""
        maps = self._optim(rank).get("param_slice_mappings")
        if not maps:
            return
        for g, mapping in enumerate(maps):
            for name, addr in mapping.items():
                mine = [p for p in self.layout.pieces.get(name, [])
                        if p.rank == rank and p.group == g]
                got = getattr(addr, "__dict__", {})
                if [(p.offset, p.numel) for p in mine] != [(got.get("start"), got.get("numel"))]:
                    raise CheckpointError(
                        f"{self._optim_paths[rank]}: param_slice_mappings puts {name} at "
                        f"{got}, the partition layout at "
                        f"{[(p.offset, p.numel) for p in mine]} (a checkpoint of another "
                        f"shape or world size)")

    def _flat(self, rank: int, group: int, column: str, path: str) -> torch.Tensor:
        o = self._optim(rank)
        if column == "master":
            key = ("single_partition_of_fp32_groups" if self.stage in (1, 2)
                   else "fp32_flat_groups")
            return need(o, key, path)[group]
        state = self._base_state(rank).get("state", {})
        if group not in state or column not in state[group]:
            raise CheckpointError(f"{path}: no {column} of flat group {group} in its "
                                  f"optimizer state")
        return state[group][column]

    def read_ds(self, ds_name: str) -> dict[str, torch.Tensor]:
        """``{column: full fp32 tensor}`` of DeepSpeed's parameter ``ds_name``, its shape."""
        shape = self.ds_shapes[ds_name]
        n = math.prod(shape)
        out = {}
        for column in self.columns:
            flat = torch.empty(n, dtype=torch.float32)
            for p in self.layout.pieces.get(ds_name, []):
                path = self._optim_paths[p.rank]
                if p.rank not in self._open and self.stage in (1, 2):
                    self._optim(p.rank)
                    self._check_slice_mappings(p.rank)
                src = self._flat(p.rank, p.group, column, path)
                if p.offset + p.numel > src.numel():
                    raise CheckpointError(
                        f"{path}: flat group {p.group} ({column}) holds {src.numel()} "
                        f"elements, {ds_name} needs up to {p.offset + p.numel} (a truncated "
                        f"or mixed-world checkpoint)")
                flat[p.start:p.start + p.numel] = src.reshape(-1)[p.offset:p.offset + p.numel]
            out[column] = flat.view(shape)
        return out

    def read(self, name: str) -> dict[str, torch.Tensor]:
        src, convert = self.names.names[name], self.names.convert
        if isinstance(src, tuple):  # made of several (their moments move as they do)
            assert convert is not None
            parts = [self.read_ds(s) for s in src]
            return {k: convert(name, [p[k] for p in parts]) for k in self.columns}
        values = self.read_ds(src)
        if convert is not None:
            values = {k: convert(name, v) for k, v in values.items()}
        return values

    def _frozen(self, ms: dict) -> dict[str, list[int]]:
        """The module's frozen parameters (in no optimizer partition) by name: those of
        ``frozen_param_shapes`` (ZeRO 2 and 3 record them), else the module's entries
        that are neither a trained parameter, a tied one's second name, nor a buffer
        (ZeRO 1 records none)."""
        recorded = ms.get("frozen_param_shapes")
        if recorded:
            return {k: [int(d) for d in v] for k, v in recorded.items()}
        module = ms.get("module") or {}
        skip = (set(self.ds_shapes) | set(ms.get("shared_params") or {})
                | set(ms.get("buffer_names") or ()))
        return {k: list(t.shape) for k, t in module.items() if k not in skip}

    def take_excluded(self, frozen: dict[str, list[int]]) -> None:
        """The loading module's frozen parameters ``frozen`` (name -> shape) that this
        checkpoint lacks: a save with ``exclude_frozen_parameters`` (which records none
        of them), so the module keeps its own values; a checkpoint that recorded frozen
        parameters and lacks these is another model's, left to the names' check."""
        missing = {n: s for n, s in frozen.items()
                   if n not in self.shapes and n not in self.frozen_shapes}
        if missing and not self.frozen_shapes:
            self.frozen_shapes = dict(missing)
            self.excludes_frozen = True
            self.notes.append(f"frozen parameters: saved without them "
                              f"(exclude_frozen_parameters); the module keeps its own "
                              f"{', '.join(list(missing)[:4])}")

    def untrained(self) -> dict[str, torch.Tensor]:
        """The module's frozen parameters and persistent buffers, whole, by name: from
        the module's state dict in the model-state file, a frozen parameter of ZeRO 3
        (partitioned like the rest) from every rank's ``frozen_param_fragments``; {} for
        the GPT routes, whose model has neither."""
        if not self._own_names:
            return {}
        ms, where = self._model_states, self.model_file
        module = ms.get("module") or {}
        buffers = [n for n in (ms.get("buffer_names") or ()) if n in module]
        # (the file's mapped tensors, not copies: the import streams them to its file)
        out = {n: module[n].detach() for n in buffers}
        if self.excludes_frozen:
            return out
        fragments = self._fragments(ms) if self.frozen_shapes else {}
        for name, shape in self.frozen_shapes.items():
            t = fragments.get(name)
            if t is None:
                t = module.get(name)
            if not isinstance(t, torch.Tensor) or t.numel() < math.prod(shape):
                raise CheckpointError(f"{where}: no value of the frozen parameter {name} "
                                      f"{shape} (frozen_param_fragments / module)")
            out[name] = t.detach().reshape(-1)[:math.prod(shape)].view(shape)
        return out

    def _fragments(self, ms: dict) -> dict[str, torch.Tensor]:
        """The frozen parameters' ``frozen_param_fragments``: whole in the one model-state
        file (ZeRO 1-2), one partition per rank's file at ZeRO 3 (concatenated in rank
        order, the padding past the parameter's size left for the caller to cut)."""
        models = _files(self.path, MODEL_FILE)
        if len(models) == 1:
            return dict(ms.get("frozen_param_fragments") or {})
        parts: dict[str, list[torch.Tensor]] = {}
        for key in sorted(models):
            got = load_file(models[key]).get("frozen_param_fragments") or {}
            for name in self.frozen_shapes:
                if name not in got:
                    raise CheckpointError(f"{models[key]}: no frozen_param_fragments of "
                                          f"{name} (an incomplete or mixed save)")
                parts.setdefault(name, []).append(got[name].reshape(-1))
        return {n: torch.cat(p) for n, p in parts.items()}

    def configure(self, config: dict) -> None:
        pass  # (the checkpoint records every shape it needs)

    def close(self) -> None:
        self._open.clear()


class DeepSpeedUniversal(DeepSpeedCheckpoint):
    """DeepSpeed's universal checkpoint (``ds_to_universal``'s ``global_stepN_universal/``:
    the model-state file, ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` holding each
    parameter whole, as ``{"param": tensor, ...}``, and ``zero/optimizer_state.pt``), read
    as the ZeRO one is: no layout, any DP size and stage load it alike."""

    def __init__(self, tag_dir: str, names=None):
        ms = self._header(tag_dir)
        self.stage, self.world = None, int(ms.get("dp_world_size") or 1)  # (what saved it)
        self.format = f"{FORMAT} universal"
        self._open = {}  # (no partition files: read_ds opens one file per value)
        self._shapes_from(ms)
        self._zero = os.path.join(tag_dir, "zero")
        missing = [n for n in self.ds_shapes
                   if not os.path.isfile(os.path.join(self._zero, n, "fp32.pt"))]
        if missing:
            raise CheckpointError(f"{self._zero}: no {missing[0]}/fp32.pt (of "
                                  f"{len(missing)} parameters of param_shapes missing): an "
                                  f"incomplete universal checkpoint")
        self._bind(ms, names)

    def _file(self, ds_name: str, what: str) -> str:
        return os.path.join(self._zero, ds_name, f"{what}.pt")

    @functools.cached_property
    def loss_scaler(self) -> dict | None:  # (fp16's: ds_to_universal keeps the scaler here)
        path = os.path.join(self._zero, "optimizer_state.pt")
        held = (load_file(path) if os.path.isfile(path) else {}).get("loss_scaler")
        return bf16.loss_scaler_state(held, self.model_state["ds_config"], path, self.notes)

    @functools.cached_property
    def columns(self) -> tuple[str, ...]:
        first = next(iter(self.ds_shapes))
        return COLUMNS if os.path.isfile(self._file(first, "exp_avg")) else COLUMNS[:1]

    @functools.cached_property
    def step(self) -> int:
        path = self._file(next(iter(self.ds_shapes)), "step")
        if not os.path.isfile(path):
            return 0
        step = load_file(path, want=(torch.Tensor, int, float))
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    def read_ds(self, ds_name: str) -> dict[str, torch.Tensor]:
        shape = self.ds_shapes[ds_name]
        out = {}
        for column, what in zip(self.columns, ("fp32", "exp_avg", "exp_avg_sq")):
            path = self._file(ds_name, what)
            saved = load_file(path, want=(dict, torch.Tensor))
            t = saved.get("param") if isinstance(saved, dict) else saved
            if not isinstance(t, torch.Tensor) or t.numel() != math.prod(shape):
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(f"{path}: holds {got}, param_shapes says {shape} (a "
                                      f"universal checkpoint of another model, or damaged)")
            out[column] = t.float().reshape(shape)
        return out


class DeepSpeedZero0(DeepSpeedCheckpoint):
    """DeepSpeed without ZeRO (stage 0, the default when the ds_config has no
    ``zero_optimization``): one ``mp_rank_00_model_states.pt`` holding the module's weights
    (fp32: the masters) and the torch optimizer's state dict, in bf16 or fp16 wrapped in
    FP16_UnfusedOptimizer's (its fp32 masters read; fp16's loss scale: :mod:`.deepspeed_bf16`).

    That state dict names no parameter: its i-th is the optimizer's i-th, which for an
    optimizer built from ``model.parameters()`` is the module's i-th parameter (buffers,
    and a tied weight's second name, left out). The order is taken so and checked by
    shape, parameter by parameter; an order it does not match (parameter groups that
    reorder the module's parameters) is one CheckpointError, as is the fused
    FP16_Optimizer's state. ``frozen``: the loading module's frozen parameters
    (``engine.load_checkpoint``), which the module's state dict holds and the optimizer
    (built from those that train) does not: left out of the order, read as frozen."""

    def __init__(self, tag_dir: str, names=None, frozen: Collection[str] = ()):
        ms = self._header(tag_dir)
        self.stage, self.world = 0, int(ms.get("dp_world_size") or 1)
        self.format = f"{FORMAT} ZeRO 0"
        self._open = {}
        osd, where = ms.get("optimizer"), self.model_file
        zero = (ms.get("ds_config") or {}).get("zero_optimization")
        stage = zero.get("stage", 0) if isinstance(zero, dict) else int(bool(zero))
        if stage or ms.get("param_shapes") is not None:
            raise CheckpointError(f"{tag_dir}: a {FORMAT} ZeRO {stage or ''} checkpoint "
                                  f"without its zero_pp_rank_*_mp_rank_00_optim_states.pt "
                                  f"files (an incomplete save)")
        if osd is None:
            raise CheckpointError(f"{where}: no optimizer state (saved without it, or by "
                                  f"an engine without an optimizer); hybrid imports a "
                                  f"{FORMAT} checkpoint to continue its training")
        self.loss_scaler = bf16.loss_scaler_state(osd, ms.get("ds_config"), where, self.notes)
        osd, self._masters = bf16.unfused_masters(ms, osd, where)
        if not isinstance(osd, dict) or set(osd) != {"state", "param_groups"}:
            keys = sorted(osd)[:5] if isinstance(osd, dict) else type(osd).__name__
            raise CheckpointError(f"{where}: the optimizer state is not a torch optimizer's "
                                  f"({keys}) nor DeepSpeed's FP16_UnfusedOptimizer's: "
                                  f"hybrid reads fp32, bf16, fp16 stage-0 checkpoints and ZeRO "
                                  f"1-3 ones")
        module = need(ms, "module", where)
        buffers, seen, params = set(ms.get("buffer_names") or ()), set(), []
        self._frozen_given = [n for n in frozen if n in module and n not in buffers]
        for name, t in module.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if name not in buffers and key not in seen and name not in frozen:
                params.append(name)
            seen.add(key)
        order = [int(i) for g in osd["param_groups"] for i in g["params"]]
        if len(order) != len(params):
            raise CheckpointError(f"{where}: the optimizer holds {len(order)} parameters, the "
                                  f"module {len(params)} it trains (frozen parameters the "
                                  f"loading module does not freeze, or parameters of another "
                                  f"model): hybrid maps them by order at stage 0")
        self._module, self._state, self._index = module, osd["state"], dict(zip(params, order))
        for name in params:
            st = self._state.get(self._index[name]) or {}
            got = st.get("exp_avg")
            if st and (got is None or tuple(got.shape) != tuple(module[name].shape)):
                raise CheckpointError(
                    f"{where}: the optimizer's parameter {self._index[name]} holds "
                    f"{list(got.shape) if got is not None else 'no exp_avg'}, the module's "
                    f"{name} is {list(module[name].shape)}: the optimizer's parameter "
                    f"order is not the module's (parameter groups that reorder them)")
        if self._masters is not None:
            self.notes.append(bf16.check_masters(self._masters, self._index, module, where))
        self._groups = [{n: list(module[n].shape) for n in params}]
        self.ds_shapes = dict(self._groups[0])
        self._bind(ms, names)

    def _frozen(self, ms: dict) -> dict[str, list[int]]:
        # (the file names none: the loading module's, when it froze some)
        return {n: list(self._module[n].shape) for n in self._frozen_given}

    @functools.cached_property
    def columns(self) -> tuple[str, ...]:
        return COLUMNS if self._state else COLUMNS[:1]

    @functools.cached_property
    def step(self) -> int:
        if not self._state:
            return 0
        step = next(iter(self._state.values())).get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)

    def read_ds(self, ds_name: str) -> dict[str, torch.Tensor]:
        master = (self._module[ds_name] if self._masters is None
                  else self._masters[self._index[ds_name]])
        out = {"master": master.float().clone()}
        if len(self.columns) > 1:
            st = self._state.get(self._index[ds_name])
            if not st:
                raise CheckpointError(f"{self.model_file}: no optimizer state for "
                                      f"{ds_name} (it never had a gradient)")
            out.update({k: st[k].float().clone() for k in COLUMNS[1:]})
        return out


def open(path: str, step: int | None = None, names=None,  # noqa: A001
         frozen: Collection[str] = ()) -> DeepSpeedCheckpoint:
    """The DeepSpeed checkpoint under ``path`` (a save directory: the tag ``latest`` names,
    or ``global_step<step>``; or one tag's directory). ``names``: a :class:`NameMap`,
    ``"module"`` for DeepSpeed's names as they are, or None: a GPT2LMHeadModel's mapped to
    hybrid's GPT (the Note on whose names), others as they are. ``frozen``: the loading
    module's frozen parameters (with ``"module"``), which a save without ZeRO names not."""
    tag_dir = _tag_dir(path, step)
    if tag_dir is None:
        what = f"global_step{step}" if step is not None else f"{LATEST} naming a tag"
        raise CheckpointError(f"{path}: no {FORMAT} checkpoint ({what} with "
                              f"*mp_rank_*_model_states.pt)")
    if _files(tag_dir, OPTIM_FILE):
        return DeepSpeedCheckpoint(tag_dir, names)
    if os.path.isdir(os.path.join(tag_dir, "zero")):
        return DeepSpeedUniversal(tag_dir, names)
    return DeepSpeedZero0(tag_dir, names, frozen)


def engine_state(path: str, step: int | None = None) -> dict:
    """The engine's counters a DeepSpeed checkpoint records (``global_steps``,
    ``global_samples``, ``skipped_steps``, ``lr_scheduler``: its state dict, or None) and
    ``client_state`` (the caller's to ``save_checkpoint``), from the one model-state file."""
    tag_dir = _tag_dir(path, step)
    if tag_dir is None:
        raise CheckpointError(f"{path}: no {FORMAT} checkpoint")
    models = _files(tag_dir, MODEL_FILE)
    if not models:
        raise CheckpointError(f"{tag_dir}: no *mp_rank_*_model_states.pt")
    ms = load_file(models[min(models)])
    out = {k: ms.get(k) for k in ("global_steps", "global_samples", "skipped_steps",
                                  "lr_scheduler")}
    out["client_state"] = {k: v for k, v in ms.items() if k not in _ENGINE_KEYS}
    return out


# What DeepSpeed's engine writes into a model-state file; the rest is the client_state.
_ENGINE_KEYS = frozenset(("module", "buffer_names", "optimizer", "param_shapes",
    "frozen_param_shapes", "ds_config", "shared_params", "frozen_param_fragments", "lr_scheduler",
    "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "ds_version", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info"))


def write(checkpoint: str, out_dir: str, dp_size: int = 1, zero_stage: int = 2, **kw) -> str:
    """The way back: hybrid checkpoint ``checkpoint`` as DeepSpeed ZeRO ``zero_stage``'s of
    ``dp_size`` ranks under ``out_dir`` (:func:`.deepspeed_export.write`)."""
    from hybrid.checkpoint.peers.deepspeed_export import write as export
    return export(checkpoint, out_dir, dp_size, zero_stage, **kw)
