"""The way back: a hybrid checkpoint written as DeepSpeed 0.19.8's ZeRO checkpoint, which
DeepSpeed's own ``engine.load_checkpoint`` loads and continues from.

The files are those DeepSpeed writes (:mod:`hybrid.checkpoint.peers.deepspeed_files`' Note),
for a DP size and a ZeRO stage (0, 1, 2 or 3) of the caller's choosing: the fp32 masters,
both Adam moments and the step count in each rank's flat partition (with DeepSpeed's
padding; without ZeRO, stage 0, the torch optimizer's state dict in the model-state
file, whose module holds the masters), the engine's ``global_steps`` and
``global_samples``, and the scheduler's state where hybrid's engine saved one (the
``hybrid.deepspeed`` door's schedulers have DeepSpeed's state dicts). DeepSpeed's own
classes in the pickles (the ZeRO stage enum, the loss scaler, the fragment addresses)
are written under DeepSpeed's names by a pickler that does not import DeepSpeed, so the
export runs where DeepSpeed is not installed.

[Note: the bf16 export]
With ``dtype="bf16"`` the files are those of DeepSpeed's bf16 run (``bf16.enabled`` in
the ds_config; :mod:`.deepspeed_bf16`' Note): the optimizer files named
``bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt``, the module's weights in the
model-state file the bf16 rounding of the fp32 masters (ZeRO 3's placeholders, the
frozen parameters and floating buffers bf16 too, as ``module.bfloat16()`` leaves them),
and the fp32 masters and moments in the optimizer files as fp32's are. At ZeRO 1 a
ds_config with ``data_types.grad_accum_dtype`` fp32 (and no optimizer offload) makes
DeepSpeed build its BF16_Optimizer, whose files differ (no ``zero_stage``, no loss
scaler, the rank's partition saved with its end padding, the padding recorded on the
last rank only): written so; otherwise ZeRO 1's optimizer's. Without ZeRO (stage 0)
DeepSpeed builds its FP16_UnfusedOptimizer in bf16 (gradients accumulated in bf16; in fp32
it refuses to start): the model-state file's ``optimizer`` holds ``fp32_groups`` (the
masters, per parameter), the torch optimizer's state dict and a static loss scale of 1.

[Note: the fp16 export]
With ``dtype="fp16"`` the files are those of DeepSpeed's fp16 run (:mod:`.deepspeed_bf16`'
Note on fp16 saves): laid out as the bf16 export's, the optimizer files named
``zero_pp_rank_*`` (no ``bf16_``), the module's weights the masters' fp16 rounding, and
the loss scaler hybrid saved as DeepSpeed's (:func:`.deepspeed_bf16.deepspeed_scaler`): at
ZeRO 1-3 its pickled DynamicLossScaler (the fp16 settings of the run's config, its scale and
hysteresis left, ``last_overflow_iter`` placed so that DeepSpeed's next doubling falls
on hybrid's step), without ZeRO FP16_UnfusedOptimizer's fields; a static scale
(``--loss-scale``) as DeepSpeed's LossScaler.

The checkpoint is read once whatever the DP size (twice at stages 1-2: the module too;
once without ZeRO, whose one file holds both),
and memory holds one parameter at a time: the ranks' partitions and the module's weights
are mapped files (:func:`_scatter_partitions`, :class:`~.spill.Spill`).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import types
from collections import OrderedDict
from typing import Any

import torch

from hybrid.checkpoint import iter_full_params, module_state, resolve_checkpoint
from hybrid.checkpoint.peers.deepspeed_bf16 import (
    bf16_enabled,
    deepspeed_scaler,
    fp16_block,
)
from hybrid.checkpoint.peers.deepspeed_files import (
    LATEST,
    STANDINS,
    DynamicLossScaler,
    FragmentAddress,
    LossScaler,
    ZeroStage,
    layout_3,
    layout_12,
)
from hybrid.checkpoint.peers.spill import Spill
from hybrid.errors import CheckpointError

VERSION = "0.19.8"  # the DeepSpeed version whose layout is written (and tested)
_DS_NAME = {cls: tuple(path.rsplit(".", 1)) for cls, path in STANDINS}


_PyPickler: Any = pickle._Pickler  # (the pure-Python pickler: save_global overridable)


class _Pickler(_PyPickler):
    """pickle's Python pickler, writing the stand-in classes under DeepSpeed's names."""

    def save_global(self, obj, name=None):
        target = _DS_NAME.get(obj)
        if target is None:
            super().save_global(obj, name)
            return
        module, qual = target
        if self.proto >= 4:
            self.save(module)
            self.save(qual)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qual}\n".encode())
        self.memoize(obj)

    dispatch = dict(_PyPickler.dispatch)


_PICKLE = types.SimpleNamespace(Pickler=_Pickler, __name__="pickle")


def _save(obj, path: str) -> None:
    torch.save(obj, path, pickle_module=_PICKLE)


def _record(cls, **attrs):
    out = cls.__new__(cls)
    out.__dict__.update(attrs)
    return out


def _align(n: int, to: int) -> int:
    return to * -(-n // to)


def write(checkpoint: str, out_dir: str, dp_size: int = 1, zero_stage: int = 2, *,
          names: dict[str, str] | None = None, convert=None, ds_config: dict | None = None,
          tag: str | None = None, param_groups: str | None = None,
          dtype: str | None = None) -> str:
    """Write hybrid checkpoint ``checkpoint`` (an ``iter_N`` or a save directory: its
    newest) as DeepSpeed ZeRO ``zero_stage`` checkpoint of ``dp_size`` ranks into
    ``out_dir/<tag>`` (default ``global_stepN``), and ``out_dir/latest`` naming it;
    return the tag's directory.

    ``names``: hybrid name -> DeepSpeed name (default: a ``pretrain_gpt.py`` GPT's as a
    transformers GPT2LMHeadModel's, with its ``config.json`` beside ``latest``; any other
    model's names as they are). ``param_groups``: DeepSpeed's optimizer groups: "saved",
    those of a ``hybrid.deepspeed`` engine's client optimizer as its script built them
    (recorded in the checkpoint; the default where they are); else each in the
    checkpoint's order (the order of the module's ``named_parameters()``):
    "matrices", two groups -- the parameters of two or more dimensions with the run's
    weight decay, then the others (biases, norm weights) without, which is hybrid's rule
    for ``pretrain_gpt.py`` and the split Hugging Face's Trainer and DeepSpeed's examples
    build (the default for a ``pretrain_gpt.py`` checkpoint); "one", every parameter in
    one group, as ``model.parameters()`` gives (the default for a ``hybrid.deepspeed``
    engine's checkpoint of one group). ``convert(hybrid_name, tensor)``: the tensor in
    DeepSpeed's layout.
    ``ds_config``: recorded in the files (DeepSpeed does not read it back).
    ``dtype``: the training dtype DeepSpeed continues in, "fp32", "bf16" or "fp16" (the
    Notes on the bf16 and fp16 exports); default: the ds_config's (``bf16.enabled``,
    ``fp16.enabled``) where one is given, else the checkpoint's own.
    CheckpointError for an existing tag, a checkpoint without optimizer state, a stage
    hybrid does not write, or a dtype it does not (:func:`_export_dtype`)."""
    if zero_stage not in (0, 1, 2, 3):
        raise CheckpointError(f"--zero-stage {zero_stage}: hybrid writes DeepSpeed ZeRO 0-3 "
                              f"checkpoints")
    if dp_size < 1:
        raise CheckpointError(f"--dp {dp_size}: at least 1")
    ckpt = resolve_checkpoint(checkpoint)
    meta, params = iter_full_params(ckpt, ("master",))
    params.close()
    shapes, frozen, buffers = _trained_frozen_buffers(ckpt, meta)
    if meta.get("zero_layout", {}).get("columns") == ["master"]:
        raise CheckpointError(f"{ckpt}: saved without optimizer state (--no-save-optim): "
                              f"a DeepSpeed checkpoint to continue from needs its moments")
    half = _export_dtype(ckpt, meta, dtype, ds_config, zero_stage)
    bf16 = half == "bf16"
    hf_config, shared = None, {}
    if names is None and "blocks.0.attn.qkv.weight" in shapes:  # hybrid's GPT: as GPT-2
        names, convert, hf_config = _gpt2_export(ckpt, meta)
        shared = {"lm_head.weight": "transformer.wte.weight"}  # tied: one parameter
    names = names or {n: n for n in shapes}
    iteration = int(meta["iteration"])
    tag = tag or f"global_step{iteration}"
    final = os.path.join(out_dir, tag)
    if os.path.exists(final):
        raise CheckpointError(f"{final}: already exists; not overwriting it")
    _check_config_json(out_dir, hf_config)
    tmp = os.path.join(out_dir, f".tmp_{tag}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # (a failure leaves nothing: a full disk is one line naming OUT)
        os.makedirs(tmp)
        ds_shapes = _ds_shapes(ckpt, shapes, names, convert)
        groups, settings = _optimizer_groups(ckpt, meta, ds_shapes, param_groups)
        api = meta.get("api") or {}
        # (a pretrain_gpt.py run's schedule is its flags': written as DeepSpeed's own
        # schedulers' state at that step, which is all their state dicts hold)
        schedule = meta.get("lr_scheduler") or {"last_batch_iteration": iteration - 1}
        record: dict[str, Any] = {
            "global_steps": int(api.get("global_steps", iteration)),
            "global_samples": int(api.get("global_samples", meta["consumed_samples"])),
            "lr_scheduler": schedule, "step": int(meta.get("step") or 0)}
        config = ds_config or {"zero_optimization": {"stage": zero_stage},
                               **({"bf16": {"enabled": True}} if bf16 else {}),
                               **({"fp16": fp16_block(meta)} if half == "fp16" else {})}
        record["scaler"] = deepspeed_scaler(meta, config, record) if half == "fp16" else None
        if half != "fp32":  # (as module.bfloat16() / .half() leaves them)
            frozen, buffers = ({n: t.to(_DTYPES[half]) if t.is_floating_point() else t
                                for n, t in d.items()} for d in (frozen, buffers))
        if zero_stage:
            _write_zero(tmp, ckpt, zero_stage, groups, settings, names, convert, dp_size,
                        int(record["step"]), config, bf16, record["scaler"])
        _write_model_states(tmp, ckpt, groups, names, convert, shared, record, dp_size,
                            zero_stage, config, frozen, buffers, half, settings)
        os.replace(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, CheckpointError):
            # (a full disk: torch.save's write errors are RuntimeErrors)
            raise CheckpointError(f"{out_dir}: cannot write the export ({e})") from e
        raise
    if hf_config is not None:  # beside latest, where Hugging Face's Trainer keeps it
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=1)
    with open(os.path.join(out_dir, f".{LATEST}.tmp"), "w") as f:
        f.write(tag)
    os.replace(os.path.join(out_dir, f".{LATEST}.tmp"), os.path.join(out_dir, LATEST))
    return final


def _check_config_json(out_dir: str, hf_config: dict | None) -> None:
    """CheckpointError when ``out_dir`` holds another model's ``config.json`` (another
    run's save directory: its tags read with it), which the export would replace."""
    path = os.path.join(out_dir, "config.json")
    if hf_config is None or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = None  # (not a config.json anything reads)
    new = json.loads(json.dumps(hf_config))
    differ = [k for k in new if isinstance(old, dict) and k in old and old[k] != new[k]]
    if differ:
        raise CheckpointError(f"{path}: another model's config.json ({', '.join(differ[:3])} "
                              f"differ), which the export would replace: give a new output "
                              f"directory")


def _write_zero(tmp: str, ckpt: str, zero_stage: int, groups: list[OrderedDict],
                settings: list[dict], names: dict, convert, dp_size: int, step: int,
                config: dict, bf16: bool, scaler=None) -> None:
    """ZeRO 1-3's optimizer files into ``tmp``: each DP rank's flat partitions
    (``scaler``: an fp16 run's loss scaler, :func:`.deepspeed_bf16.deepspeed_scaler`)."""
    kind = ("BF16_Optimizer" if bf16 and zero_stage == 1 and _bf16_optimizer(config)
            else "ZeRO")
    prefix = "bf16_" if bf16 else ""
    totals = [sum(math.prod(s) for s in g.values()) for g in groups]
    if zero_stage in (1, 2):
        parts = [_align(t, 2 * dp_size) // dp_size for t in totals]
        layout = layout_12(groups, dp_size, parts, None)
    else:  # (one sub-group per group: DeepSpeed's default sub_group_size is 1e9)
        parts = [sum(-(-math.prod(s) // dp_size) for s in g.values()) for g in groups]
        layout = layout_3(groups, dp_size, parts)
    spill = Spill(os.path.join(tmp, ".partitions"))
    try:
        flats = _scatter_partitions(ckpt, spill, dp_size, parts, names, convert, layout)
        for rank, flat in enumerate(flats):
            osd = _optimizer_state(flat, rank, dp_size, zero_stage, parts, totals, groups,
                                   layout, settings, step, config, kind, scaler)
            _save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": VERSION},
                  os.path.join(tmp, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_"
                                    f"states.pt"))
            del osd
        del flats
    finally:
        spill.close()


_COLUMNS = ("master", "exp_avg", "exp_avg_sq")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _export_dtype(ckpt: str, meta: dict, dtype: str | None, ds_config: dict | None,
                  zero_stage: int) -> str:
    """"fp32", "bf16" or "fp16": ``dtype``, else the ds_config's, else the checkpoint's
    training dtype. Another name, a dtype the given ds_config contradicts (the files would
    not be what DeepSpeed saves under it), or bf16 without ZeRO under a ds_config that
    accumulates gradients in fp32 (DeepSpeed 0.19.8 does not start so): one
    CheckpointError."""
    cfg = meta.get("config") or {}
    said = None
    if ds_config is not None:
        fp16 = ds_config.get("fp16")
        if isinstance(fp16, dict) and str(fp16.get("enabled")).lower() == "true":
            said = "fp16"
        else:
            said = "bf16" if bf16_enabled(ds_config) else "fp32"
    want = dtype or said or ("bf16" if cfg.get("bf16") else "fp16" if cfg.get("fp16")
                             else "fp32")
    if want not in ("fp32", "bf16", "fp16"):
        raise CheckpointError(f"{ckpt}: --dtype {want}: fp32, bf16 or fp16")
    if said is not None and said != want:
        raise CheckpointError(f"{ckpt}: --dtype {want}, but the ds_config given trains in "
                              f"{said}: DeepSpeed under that config saves (and loads) "
                              f"{said} files; give one that enables {want}")
    accum = ((ds_config or {}).get("data_types") or {}).get("grad_accum_dtype")
    if want == "bf16" and zero_stage == 0 and accum in ("fp32", "float32"):
        raise CheckpointError(f"{ckpt}: bf16 without ZeRO (--zero-stage 0) under a ds_config "
                              f"with data_types.grad_accum_dtype {accum}: DeepSpeed 0.19.8 "
                              f"does not train so (bf16 weights with fp32 gradient "
                              f"accumulation need ZeRO); use ZeRO 1 (its BF16_Optimizer) "
                              f"or grad_accum_dtype bf16")
    return want


def _bf16_optimizer(config: dict) -> bool:
    """Whether DeepSpeed 0.19.8 builds its BF16_Optimizer at ZeRO 1 in bf16 under
    ``config``: gradients accumulated in fp32, no optimizer offload to the CPU."""
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    offload = ((config.get("zero_optimization") or {}).get("offload_optimizer") or {})
    return accum in ("fp32", "float32") and offload.get("device") not in ("cpu",)


def _trained_frozen_buffers(ckpt: str, meta: dict) -> tuple[dict, dict, dict]:
    """(the trained parameters' shapes, the frozen parameters, the buffers) of checkpoint
    ``ckpt``. A hybrid.deepspeed module's frozen parameters and buffers are in no unit,
    so not in the optimizer's partitions; DeepSpeed keeps them in its model-state files.
    Saved with ``exclude_frozen_parameters``, the frozen ones are names only, and are
    left out as DeepSpeed's own such save leaves them."""
    untrained = module_state.read(ckpt, meta)
    frozen = {n: untrained[n] for n in meta["model"] if n in untrained}
    skip = set(meta.get("frozen_parameters") or ()) | set(frozen)
    shapes = {n: list(s) for n, s in meta["model"].items() if n not in skip}
    return shapes, frozen, {n: t for n, t in untrained.items() if n not in frozen}


def _scatter_partitions(ckpt: str, spill: Spill, dp_size: int, parts: list[int],
                        names: dict[str, str], convert, layout
                        ) -> list[list[dict[str, torch.Tensor]]]:
    """Every DP rank's flat partitions of each group (master and both moments,
    ``parts[g]`` elements each, zero where DeepSpeed pads), filled in one pass over the
    checkpoint: ``[rank][group][column]``.

    [Note: one read of the checkpoint, whatever the DP size]
    A rank's partition takes a slice of every parameter at stage 3 (and of a run of
    them at stages 1-2), so filling one rank at a time would read the checkpoint once
    per rank: O(model x DP) bytes. Here each parameter is read once and its pieces go
    to every rank's partition, and the partitions are mapped files (:class:`Spill`), so
    memory holds one parameter, not the model's state."""
    flats = [[{k: spill.zeros(part) for k in _COLUMNS} for part in parts]
             for _ in range(dp_size)]
    _, params = iter_full_params(ckpt, _COLUMNS)
    for name, values in params:
        pieces = layout.pieces[names[name]]
        for k, v in values.items():
            whole = (convert(name, v) if convert is not None else v).reshape(-1)
            for p in pieces:
                flats[p.rank][p.group][k][p.offset:p.offset + p.numel] = \
                    whole[p.start:p.start + p.numel]
    return flats


def _frozen_fragments(frozen: dict[str, torch.Tensor], rank: int, dp_size: int,
                      zero_stage: int) -> OrderedDict | None:
    """DeepSpeed's ``frozen_param_fragments`` of one rank's model-state file: none at
    stages 0-1 (DeepSpeed records frozen parameters from stage 2 on; the module holds
    them), each whole at stage 2, at stage 3 the rank's partition of each (its share of
    ``ceil(numel / dp)`` elements, zero-padded past the end) as ZeRO 3 splits it."""
    if zero_stage < 2:
        return None
    out = OrderedDict()
    for name, t in frozen.items():
        if zero_stage == 2:
            out[name] = t
            continue
        flat, part = t.reshape(-1), -(-t.numel() // dp_size)
        piece = torch.zeros(part, dtype=t.dtype)
        mine = flat[rank * part:(rank + 1) * part]
        piece[:mine.numel()] = mine
        out[name] = piece
    return out


def _write_model_states(tmp: str, ckpt: str, groups: list[OrderedDict], names: dict,
                        convert, shared: dict, record: dict, dp_size: int, zero_stage: int,
                        config: dict, frozen: dict[str, torch.Tensor],
                        buffers: dict[str, torch.Tensor], half: str,
                        settings: list[dict]) -> None:
    """The model-state file(s) into ``tmp``: DeepSpeed's engine record (``record``'s
    counters and schedule, ``param_shapes``, ``shared_params``) with the module -- at
    stage 3 one file per rank, the parameters as empty placeholders; else one file, the
    module's weights the masters (fp32 training) or their rounding (``half``: "bf16",
    "fp16"),
    read one parameter at a time; at stage 0 with the optimizer's state too
    (:func:`_stage0_optimizer`). A
    module's ``frozen`` parameters and ``buffers`` (whole) go where DeepSpeed keeps
    them: the buffers in the module (``buffer_names``), the frozen parameters in the
    module at stages 0-2 and as ``frozen_param_shapes`` / ``frozen_param_fragments``
    from stage 2 on (:func:`_frozen_fragments`)."""
    ds_shapes = {n: s for g in groups for n, s in g.items()}
    dtype, lowp = _DTYPES[half], half != "fp32"  # (bf16, fp16: masters apart)
    model_state = {"buffer_names": list(buffers), "optimizer": None,
                   "param_shapes": None if not zero_stage else [
                       OrderedDict((n, torch.Size(s)) for n, s in g.items()) for g in groups],
                   "frozen_param_shapes": (None if zero_stage < 2 else OrderedDict(
                       (n, t.shape) for n, t in frozen.items())),
                   "shared_params": dict(shared) if zero_stage else None,
                   "lr_scheduler": record["lr_scheduler"], "data_sampler": None,
                   "random_ltd": None, "skipped_steps": 0,
                   "global_steps": record["global_steps"],
                   "global_samples": record["global_samples"], "dp_world_size": dp_size,
                   "mp_world_size": 1,
                   "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
                   "ds_config": config, "ds_version": VERSION}
    if zero_stage == 3:  # every rank's file, the module's parameters as empty placeholders
        for rank in range(dp_size):
            module = OrderedDict((n, torch.empty(0, dtype=dtype))
                                 for n in [*ds_shapes, *frozen])
            for alias, of in shared.items():
                module[alias] = module[of]
            module.update(buffers)
            _save({"module": module, **model_state, "frozen_param_fragments":
                   _frozen_fragments(frozen, rank, dp_size, zero_stage)},
                  os.path.join(tmp, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
    else:  # the whole module, its weights the masters' (in dtype), in mapped files
        spill = Spill(os.path.join(tmp, ".module"))
        try:
            _, params = iter_full_params(ckpt, ("master",) if zero_stage else _COLUMNS)
            module, state = OrderedDict(), {}
            for name, values in params:
                v = {k: convert(name, t) if convert is not None else t
                     for k, t in values.items()}
                module[names[name]] = spill.keep(v["master"].to(dtype))
                if not zero_stage:  # (fp32: the module's weights are the masters)
                    state[names[name]] = {k: spill.keep(t) for k, t in v.items()
                                          if lowp or k != "master"}
            if not zero_stage:  # (the module's order, which a save without ZeRO keeps)
                model_state["optimizer"] = _stage0_optimizer(state, groups, settings,
                                                             record, half)
                module = OrderedDict((d, module[d]) for d in names.values() if d in module)
            for alias, of in shared.items():  # (the module's state dict names both)
                module[alias] = module[of]
            module.update(frozen)
            module.update(buffers)
            _save({"module": module, **model_state, "frozen_param_fragments":
                   _frozen_fragments(frozen, 0, dp_size, zero_stage)},
                  os.path.join(tmp, "mp_rank_00_model_states.pt"))
        finally:
            spill.close()


def _stage0_optimizer(state: dict[str, dict[str, torch.Tensor]], groups: list[OrderedDict],
                      settings: list[dict], record: dict, half: str) -> dict:
    """The model-state file's ``optimizer`` without ZeRO (``state``: each parameter's
    moments, and its fp32 master in bf16, by DeepSpeed name): torch AdamW's state dict,
    its parameters numbered in the groups' order; in bf16 wrapped as DeepSpeed's
    FP16_UnfusedOptimizer saves it (:mod:`.deepspeed_bf16`' Note), the masters in
    ``fp32_groups`` and a static loss scale of 1 (fp16: the run's scaler's fields)."""
    order = [n for g in groups for n in g]
    step = torch.tensor(float(record["step"]))
    first = [sum(len(g) for g in groups[:i]) for i in range(len(groups))]
    base = {"state": {i: {"step": step.clone(), "exp_avg": state[n]["exp_avg"],
                          "exp_avg_sq": state[n]["exp_avg_sq"]} for i, n in enumerate(order)},
            "param_groups": [{**s, "params": list(range(at, at + len(g)))}
                             for g, s, at in zip(groups, settings, first)]}
    if half == "fp32":
        return base
    scaler = record.get("scaler") or {"dynamic": False, "fields": {"cur_scale": 1.0}}
    fields = {k: scaler["fields"][k] for k in ("cur_scale", "cur_iter", "last_overflow_iter",
                                               "scale_factor", "scale_window")
              if k in scaler["fields"]}
    return {"dynamic_loss_scale": scaler["dynamic"], "cur_iter": record["global_steps"],
            **fields, "optimizer_state_dict": base,
            "fp32_groups": [[state[n]["master"] for n in g] for g in groups]}


def _optimizer_state(flat: list[dict[str, torch.Tensor]], rank: int, dp_size: int,
                     zero_stage: int, parts: list[int], totals: list[int],
                     groups: list[OrderedDict], layout, settings: list[dict], step: int,
                     config: dict, kind: str = "ZeRO", fp16=None) -> dict:
    """DP rank ``rank``'s ``optimizer_state_dict`` as DeepSpeed's ZeRO ``zero_stage``
    optimizer saves it: per group ``g``, ``flat[g]``'s partition of ``parts[g]`` elements
    (master and both moments; ``totals[g]`` the group's elements), with the fragment
    addresses (stages 1-2) that DeepSpeed's loader checks; ``settings[g]`` the group's
    torch AdamW settings. ``kind`` "BF16_Optimizer": that optimizer's state at ZeRO 1
    (the Note on the bf16 export). ``fp16``: an fp16 run's scaler
    (:func:`.deepspeed_bf16.deepspeed_scaler`)."""
    state = {g: {"step": torch.tensor(float(step)), "exp_avg": f["exp_avg"],
                 "exp_avg_sq": f["exp_avg_sq"]} for g, f in enumerate(flat)}
    base = {"state": state,
            "param_groups": [{**s, "params": [g]} for g, s in enumerate(settings)]}
    scaler = _record(LossScaler, cur_scale=1.0, dynamic=False)
    dynamic = bool(fp16 and fp16["dynamic"])
    if fp16:
        scaler = _record(DynamicLossScaler if dynamic else LossScaler, **fp16["fields"])
    if zero_stage == 3:
        return {"zero_stage": ZeroStage(zero_stage), "loss_scaler": scaler,
                "dynamic_loss_scale": dynamic, "overflow": False, "partition_count": dp_size,
                "optimizer_state_dict": base, "fp32_flat_groups": [f["master"] for f in flat]}
    pads = [min(part, max(0, (rank + 1) * part - total))  # past the group's end
            for part, total in zip(parts, totals)]
    mappings = [OrderedDict((n, _record(FragmentAddress, numel=p.numel, start=p.offset))
                            for n in shapes for p in layout.pieces[n] if p.rank == rank)
                for shapes in groups]
    clip = float(config.get("gradient_clipping", 0.0))
    if kind == "BF16_Optimizer":  # (the whole partition; the padding on the last rank)
        last = rank == dp_size - 1
        return {"clip_grad": clip, "base_optimizer_state": base,
                "single_partition_of_fp32_groups": [f["master"] for f in flat],
                "group_paddings": [dp_size * part - total if last else 0
                                   for part, total in zip(parts, totals)],
                "partition_count": [dp_size] * len(groups), "ds_version": VERSION,
                "param_slice_mappings": mappings}
    return {"loss_scaler": scaler, "dynamic_loss_scale": dynamic, "overflow": False,
            "clip_grad": clip, "base_optimizer_state": base,
            "single_partition_of_fp32_groups": [f["master"][:part - pad].clone()
                                                for f, part, pad in zip(flat, parts, pads)],
            "zero_stage": ZeroStage(zero_stage), "group_paddings": pads,
            "param_alignment_paddings": [[0] * len(g) for g in groups],
            "partition_count": [dp_size] * len(groups), "ds_version": VERSION,
            "param_slice_mappings": mappings}


def _gpt2_export(ckpt: str, meta: dict):
    """(names, convert, config.json) writing hybrid's GPT as a transformers
    GPT2LMHeadModel (hybrid.hf.gpt2's table; the vocabulary's padding rows dropped);
    CheckpointError for a GPT that is not GPT-2 shaped (RMSNorm, SwiGLU, rotary, ...)."""
    from hybrid.config.architecture import architecture_fields
    from hybrid.hf.gpt2 import hf_config, hf_names, param_to_hf
    cfg = meta.get("config") or {}
    arch = architecture_fields(cfg)
    gpt2 = {"normalization": "LayerNorm", "swiglu": False,
            "position_embedding_type": "learned_absolute", "num_query_groups": None,
            "untie_embeddings_and_output_weights": False, "add_bias_linear": True,
            "qk_layernorm": False, "add_qkv_bias": False}
    differ = [f"{k}={arch[k]!r}" for k, v in gpt2.items() if arch[k] != v]
    if differ:
        raise CheckpointError(f"{ckpt}: a GPT with {', '.join(differ)}: hybrid writes "
                              f"DeepSpeed checkpoints of GPT-2 shaped models (a "
                              f"transformers GPT2LMHeadModel)")
    vocab, heads = meta.get("vocab_size"), int(cfg["num_attention_heads"])
    if vocab is None:
        raise CheckpointError(f"{ckpt}: no vocab_size in its metadata.json")
    names = hf_names(int(cfg["num_layers"]))
    extra = sorted(set(meta["model"]) - set(names))
    if extra:
        raise CheckpointError(f"{ckpt}: parameters GPT-2 has not: {', '.join(extra[:4])}")

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        t = param_to_hf(name, t, heads)
        return (t[:vocab] if name == "wte.weight" else t).contiguous()
    return names, convert, hf_config(cfg, int(vocab))


def _ds_shapes(ckpt: str, shapes: dict[str, list[int]], names: dict[str, str],
               convert) -> OrderedDict:
    """DeepSpeed name -> shape, in the checkpoint's order (a ``convert`` may change a
    shape: GPT-2's transposed Conv1D weights; the shape is taken from a meta tensor)."""
    out: OrderedDict = OrderedDict()
    for n, s in shapes.items():
        if n not in names:
            raise CheckpointError(f"{ckpt}: parameter {n} has no DeepSpeed name")
        shape = s if convert is None else convert(n, torch.empty(s, device="meta")).shape
        out[names[n]] = torch.Size(shape)
    return out


def _optimizer_groups(ckpt: str, meta: dict, ds_shapes: OrderedDict, mode: str | None
                      ) -> tuple[list[OrderedDict], list[dict]]:
    """(DeepSpeed's optimizer groups as name -> shape, in the checkpoint's order; each
    one's torch AdamW settings) for ``param_groups`` ``mode`` (:func:`write`)."""
    saved = meta.get("optimizer_groups") or []
    members = meta.get("optimizer_group_members")
    if mode is None:
        mode = ("saved" if members else "one") if meta.get("api") else "matrices"
    if mode == "saved":  # a hybrid.deepspeed engine's client groups, as its script built them
        if not members:
            raise CheckpointError(f"{ckpt}: records no optimizer groups (a pretrain_gpt.py "
                                  f"run's, or one of hybrid's AdamW): 'matrices' or 'one'")
        to_ds = dict(zip(meta["model"], ds_shapes))  # (hybrid -> DeepSpeed, in order)
        groups = [OrderedDict((to_ds[n], ds_shapes[to_ds[n]]) for n in g) for g in members]
        return groups, [_param_group(meta, [s]) for s in saved]
    if len(saved) > 1:
        raise CheckpointError(f"{ckpt}: its optimizer has {len(saved)} parameter groups, "
                              f"whose members the checkpoint does not record (saved before "
                              f"hybrid recorded them): hybrid writes it as DeepSpeed's with "
                              f"one group or the matrices/others split (--param-groups)")
    if mode not in ("one", "matrices"):
        raise CheckpointError(f"--param-groups {mode!r}: 'matrices' or 'one'")
    base = _param_group(meta, saved)
    if mode == "one":
        return [ds_shapes], [base]
    split = [OrderedDict((n, s) for n, s in ds_shapes.items() if (len(s) >= 2) == matrix)
             for matrix in (True, False)]
    decay = [base["weight_decay"], 0.0]
    kept = [(g, {**base, "weight_decay": d}) for g, d in zip(split, decay) if g]
    return [g for g, _ in kept], [s for _, s in kept]


def _param_group(meta: dict, saved: list[dict]) -> dict:
    """torch AdamW's group settings for DeepSpeed's base optimizer: the ones the engine
    saved (``optimizer_groups``: the rate the schedule last set), else the config's."""
    cfg = meta.get("config") or {}
    g = dict(saved[0]) if saved else {}
    betas = g.get("betas") or [cfg.get("adam_beta1", 0.9), cfg.get("adam_beta2", 0.999)]
    return {"lr": float(g.get("lr", cfg.get("lr", 1e-3))), "betas": tuple(betas),
            "eps": float(g.get("eps", cfg.get("adam_eps", 1e-8))),
            "weight_decay": float(g.get("weight_decay", cfg.get("weight_decay", 0.0))),
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
            "differentiable": False, "fused": None, "decoupled_weight_decay": True}
