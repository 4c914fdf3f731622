"""DeepSpeed's bf16 and fp16 saves, for the reader (:mod:`.deepspeed`): which files a
save's optimizer state is in, BF16_Optimizer's flat partitions, the fp32 masters of
DeepSpeed's FP16_UnfusedOptimizer, and an fp16 run's loss scaler as hybrid's (and, for
the export, hybrid's as DeepSpeed's).

[Note: DeepSpeed 0.19.8's bf16 saves]
A bf16 run keeps fp32 masters beside the bf16 module weights (their rounding, which are
never read as masters). DeepSpeed picks its optimizer wrapper by stage and gradient
accumulation dtype (``engine._do_optimizer_sanity_check``):

* without ZeRO: FP16_UnfusedOptimizer in bf16 (for torch's optimizers; the fused
  FP16_Optimizer for DeepSpeed's fused Adam). No optimizer files: the model-state file's
  ``optimizer`` holds ``fp32_groups`` (group g's masters, one tensor per parameter in the
  torch optimizer's ``param_groups[g]`` order), ``optimizer_state_dict`` (the torch
  optimizer's) and the loss-scale fields. It builds its optimizer's state with one step of
  zero gradients, so Adam's step is one more than the engine's.
* ZeRO 1 with ``data_types.grad_accum_dtype`` fp32 (and a pipeline engine's bf16 without
  ZeRO: Megatron-DeepSpeed's, BLOOM's): BF16_Optimizer. ``bf16_zero_pp_rank_R_mp_rank_00_
  optim_states.pt`` per DP rank holds ZeRO 1's flat partitions without ``zero_stage`` or
  alignment paddings: ``single_partition_of_fp32_groups[g]`` is rank R's whole partition
  (the last rank's end padding, ``group_paddings[g]``, included), ``base_optimizer_state``
  the torch optimizer's, ``param_slice_mappings`` the parameters' places. Read as ZeRO 1's.
  A pipeline stage's (``bf16_zero_pp_rank_R_mp_rank_SS_optim_states.pt``) comes without
  ``param_shapes`` (None in its model-state file, whose ``optimizer`` repeats the state):
  its parameters' names and order are the ranks' ``param_slice_mappings``
  (:func:`slice_names`), their shapes the layer files'.
* ZeRO 1-3 otherwise: the ZeRO optimizers, their files named ``bf16_zero_pp_rank_*`` (any
  bf16 run's are), read as fp32's.

[Note: DeepSpeed 0.19.8's fp16 saves]
An fp16 run's files are laid out as the bf16 run's above (the optimizer files named
``zero_pp_rank_*``, without ``bf16_``; without ZeRO, FP16_UnfusedOptimizer's state in the
model-state file), the module's fp16 weights the rounding of the fp32 masters, which are
read. Its loss scale comes over as hybrid's :class:`~hybrid.zero.loss_scaler.LossScaler`
state (:func:`loss_scaler_state`): ZeRO 1-3 pickle their DynamicLossScaler
(``loss_scaler``: ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``,
...), FP16_UnfusedOptimizer saves ``cur_scale``, ``cur_iter`` and ``last_overflow_iter``
and has no hysteresis (it halves on every overflow). DeepSpeed doubles the scale when
``cur_iter - last_overflow_iter - 1`` is a positive multiple of the window, hybrid when
its count of clean steps is: the count is set so that the next doubling falls on
DeepSpeed's step. After an overflow DeepSpeed waits window + 1 clean steps, hybrid
window (Megatron's rule): a line of the import's notes says so.
"""

from __future__ import annotations

import math
import os

import torch

from hybrid.checkpoint.peers.deepspeed_files import OPTIM_FILE, Layout, layout_12, need
from hybrid.errors import CheckpointError


def bf16_enabled(ds_config) -> bool | None:
    """Whether a saved ds_config enables bf16 (None: no ds_config saved)."""
    if not isinstance(ds_config, dict):
        return None
    block = ds_config.get("bf16", ds_config.get("bfloat16"))
    enabled = block.get("enabled") if isinstance(block, dict) else None
    return enabled is True or str(enabled).lower() == "true"


def fp16_enabled(ds_config) -> bool:
    """Whether a saved ds_config enables fp16."""
    block = ds_config.get("fp16") if isinstance(ds_config, dict) else None
    enabled = block.get("enabled") if isinstance(block, dict) else None
    return enabled is True or str(enabled).lower() == "true"


def loss_scaler_state(held, ds_config, where: str, notes: list[str]) -> dict | None:
    """hybrid's LossScaler state dict for an fp16 run's loss scaler ``held`` (the Note on
    fp16 saves: a ZeRO optimizer file's pickled scaler, or FP16_UnfusedOptimizer's state
    dict), appending to ``notes`` what does not map; None for a run not in fp16 (its
    scale is 1). A scaler without a scale or its counters is one CheckpointError naming
    ``where``."""
    if not fp16_enabled(ds_config):
        return None
    attrs: dict = held if isinstance(held, dict) else getattr(held, "__dict__", {})
    scale = attrs.get("cur_scale")
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise CheckpointError(f"{where}: an fp16 run's file without its loss scale "
                              f"(cur_scale {scale!r})")
    dynamic = attrs.get("dynamic", attrs.get("dynamic_loss_scale")) is True
    if not dynamic:
        return {"scale": float(scale), "clean_steps": 0, "hysteresis_left": 1}
    unfused = isinstance(held, dict)  # (FP16_UnfusedOptimizer: no hysteresis)
    at, last = attrs.get("cur_iter"), attrs.get("last_overflow_iter")
    if not isinstance(at, int) or not isinstance(last, int) or last >= at:
        raise CheckpointError(f"{where}: an fp16 run's dynamic loss scale without its "
                              f"counters (cur_iter {at!r}, last_overflow_iter {last!r})")
    clean = at - last - 2
    notes += [f"fp16 loss scale {float(scale):g} carried over (next doubling at DeepSpeed's "
             f"step); after an overflow hybrid doubles it after fp16.loss_scale_window "
             f"clean steps, DeepSpeed after one more"]
    if unfused:
        notes.append("fp16 without ZeRO: DeepSpeed's FP16_UnfusedOptimizer halves the "
                     "scale on every overflow (no hysteresis): the import leaves one "
                     "overflow to the next halving; after the scale grows, hybrid's "
                     "fp16.hysteresis applies (set it to 1 to keep DeepSpeed's)")
    elif attrs.get("consecutive_hysteresis"):
        notes.append("fp16 consecutive_hysteresis: DeepSpeed restored the hysteresis "
                     "after each clean step; hybrid restores it when the scale grows")
    return {"scale": float(scale), "clean_steps": clean,
            "hysteresis_left": 1 if unfused else int(attrs.get("cur_hysteresis", 1))}


def fp16_block(meta: dict) -> dict:
    """The ds_config ``fp16`` block of the checkpoint's run (its loss-scale flags)."""
    cfg = meta.get("config") or {}
    static = cfg.get("loss_scale")
    return {"enabled": True, "loss_scale": float(static or 0),
            "initial_scale_power": int(math.log2(float(cfg.get("initial_loss_scale") or
                                                        2.0 ** 16))),
            "loss_scale_window": int(cfg.get("loss_scale_window") or 1000),
            "hysteresis": int(cfg.get("hysteresis") or 2),
            "min_loss_scale": float(cfg.get("min_loss_scale") or 1.0)}


def deepspeed_scaler(meta: dict, config: dict, record: dict) -> dict:
    """The export's (:mod:`.deepspeed_export`): hybrid's fp16 loss scaler as DeepSpeed
    holds it, :func:`loss_scaler_state` backwards:
    ``{"dynamic": bool, "fields": {...}}``, the fields DeepSpeed's DynamicLossScaler (or
    static LossScaler) pickles. The scale and counters are the checkpoint's
    (``loss_scaler``), the settings ``config``'s fp16 block."""
    given = config.get("fp16")
    block: dict = given if isinstance(given, dict) else fp16_block(meta)
    saved = meta.get("loss_scaler") or {}
    static = float(block.get("loss_scale") or 0)
    if static:
        return {"dynamic": False, "fields": {"cur_scale": static, "dynamic": False}}
    hysteresis = int(block.get("hysteresis", 2))
    scale = float(saved.get("scale", 2.0 ** int(block.get("initial_scale_power", 16))))
    at = int(record["global_steps"])  # (DeepSpeed doubles at a positive multiple of the
    clean = int(saved.get("clean_steps", 0))  # window of at - last_overflow_iter - 1)
    return {"dynamic": True, "fields": {
        "cur_scale": scale, "dynamic": True, "cur_iter": at,
        "last_overflow_iter": at - clean - 2 if clean >= 0 else at - 1,
        "scale_factor": 2.0, "scale_window": int(block.get("loss_scale_window", 1000)),
        "min_scale": float(block.get("min_loss_scale", 1.0)), "delayed_shift": hysteresis,
        "cur_hysteresis": max(1, int(saved.get("hysteresis_left", hysteresis))),
        "consecutive_hysteresis": False, "raise_error_at_min_scale": True,
        "dtype": torch.float16}}


def is_bf16_optimizer(optim: dict) -> bool:
    """Whether an optimizer file's state is BF16_Optimizer's: ZeRO 1's flat fp32
    partitions without a ``zero_stage``."""
    return "zero_stage" not in optim and "single_partition_of_fp32_groups" in optim


def optim_kind(optim: dict) -> str:
    if is_bf16_optimizer(optim):
        return "BF16_Optimizer"
    stage = optim.get("zero_stage")
    return f"zero_stage {int(stage)}" if stage is not None else "no zero_stage"


def optim_prefix(tag_dir: str, ds_config, model_file: str) -> str:
    """The prefix of the save's optimizer file names: ``bf16_`` for a bf16 run (whatever
    its stage), else none. A file named otherwise than the ds_config's bf16 says, or than
    the others, is another save's: one CheckpointError naming it."""
    names = [n for n in sorted(os.listdir(tag_dir)) if OPTIM_FILE.match(n)]
    bf16 = bf16_enabled(ds_config)
    if bf16 is None:  # (no ds_config: the first file's naming rules)
        bf16 = bool(names) and names[0].startswith("bf16_")
    odd = [n for n in names if n.startswith("bf16_") != bf16]
    if odd:
        what = ("not a bf16 run's optimizer file (bf16_zero_pp_rank_*), but the ds_config "
                "in {m} enables bf16" if bf16 else
                "a bf16 run's optimizer file, but the ds_config in {m} does not enable bf16")
        raise CheckpointError(f"{os.path.join(tag_dir, odd[0])}: "
                              f"{what.format(m=os.path.basename(model_file))} "
                              f"(files of two saves mixed)")
    return "bf16_" if bf16 else ""


def bf16_layout(groups, world: int, first: dict, path: str, stage: int | None,
                model_file: str) -> Layout:
    """BF16_Optimizer's partitions (the Note), from rank 0's file ``first`` at ``path``;
    ``stage``: the ds_config's (0 or 1 where BF16_Optimizer saves)."""
    if stage not in (None, 0, 1):
        raise CheckpointError(f"{path}: DeepSpeed's BF16_Optimizer state (no zero_stage), "
                              f"but the ds_config in {os.path.basename(model_file)} says "
                              f"ZeRO {stage} (files of two saves mixed)")
    part = [int(t.numel()) for t in need(first, "single_partition_of_fp32_groups", path)]
    try:
        return layout_12(groups, world, part, None)
    except ValueError as e:
        raise CheckpointError(f"{path}: its partitions do not match param_shapes of "
                              f"{os.path.basename(model_file)}: {e}") from None


def slice_names(optims: list[dict], paths: list[str]) -> list[list[str]]:
    """The parameter names of each group of a pipeline stage's BF16_Optimizer without ZeRO
    (``optims``: its DP ranks' ``optimizer_state_dict``s, from ``paths``), in their flat
    order: the union, in rank order, of the ranks' ``param_slice_mappings`` (which such a
    save has in place of ``param_shapes``: the Note)."""
    groups: list[dict[str, None]] = []
    for optim, path in zip(optims, paths):
        if not is_bf16_optimizer(optim):
            raise CheckpointError(f"{path}: {optim_kind(optim)}, but the pipeline save's "
                                  f"ds_config says bf16 without ZeRO, whose optimizer is "
                                  f"BF16_Optimizer (files of two saves mixed)")
        maps = need(optim, "param_slice_mappings", path)
        if groups and len(maps) != len(groups):
            raise CheckpointError(f"{path}: {len(maps)} parameter groups, "
                                  f"{os.path.basename(paths[0])} {len(groups)} (files of "
                                  f"two saves mixed)")
        groups = groups or [{} for _ in maps]
        for names, mapping in zip(groups, maps):
            names.update(dict.fromkeys(mapping))
    return [list(g) for g in groups]


def check_same_save(mine: dict, path: str, first: dict, first_path: str) -> None:
    """A rank's optimizer file ``mine`` is of rank 0's kind (``first``): the same ZeRO
    stage, or BF16_Optimizer's with partitions of the same size."""
    kind, want = optim_kind(mine), optim_kind(first)
    if kind == want == "BF16_Optimizer":
        kind, want = (f"{kind} partitions of "
                      f"{[int(t.numel()) for t in o['single_partition_of_fp32_groups']]}"
                      for o in (mine, first))
    if kind != want:
        raise CheckpointError(f"{path}: {kind}, but {os.path.basename(first_path)} holds "
                              f"{want} (files of two saves mixed)")


def unfused_masters(ms: dict, osd, where: str) -> tuple:
    """(the torch optimizer's state dict, the fp32 masters by its parameter index) of a
    stage-0 model-state file's ``optimizer`` ``osd``: DeepSpeed's FP16_UnfusedOptimizer's
    in bf16 (the Note); ``(osd, None)`` for a torch optimizer's own (fp32: the module's
    weights are the masters). In fp16 the same (its loss scale: :func:`loss_scaler_state`).
    The fused FP16_Optimizer is one CheckpointError."""
    if not isinstance(osd, dict) or "optimizer_state_dict" not in osd:
        return osd, None
    if "fp32_groups" not in osd:
        raise CheckpointError(f"{where}: DeepSpeed's fused FP16_Optimizer state "
                              f"({sorted(osd)[:6]}: one flat fp32 master per group): hybrid "
                              f"reads the unfused one DeepSpeed wraps torch's optimizers in")
    inner = osd["optimizer_state_dict"]
    if not isinstance(inner, dict) or "param_groups" not in inner:
        raise CheckpointError(f"{where}: no torch optimizer state in its optimizer's "
                              f"optimizer_state_dict")
    order = [int(i) for g in inner["param_groups"] for i in g["params"]]
    masters = [t for g in osd["fp32_groups"] for t in g]
    if len(masters) != len(order) or any(
            not isinstance(t, torch.Tensor) or t.dtype != torch.float32 for t in masters):
        raise CheckpointError(f"{where}: fp32_groups holds {len(masters)} tensors (fp32 "
                              f"ones?), the optimizer {len(order)} parameters")
    return inner, dict(zip(order, masters))


def check_masters(masters: dict, index: dict, module: dict, where: str) -> str:
    """Each module parameter's fp32 master (by its optimizer index) has its shape: else
    the optimizer's order is not the module's. Returns the note saying where the masters
    come from."""
    for name, i in index.items():
        got = masters.get(i)
        if got is None or tuple(got.shape) != tuple(module[name].shape):
            raise CheckpointError(
                f"{where}: the optimizer's fp32 master {i} is "
                f"{list(got.shape) if got is not None else 'missing'}, the module's {name} "
                f"is {list(module[name].shape)}: the optimizer's parameter order is not the "
                f"module's")
    half = {torch.float16: "fp16", torch.bfloat16: "bf16"}
    dtype = next((half[t.dtype] for t in module.values() if t.dtype in half), "bf16/fp16")
    return (f"{dtype}: the fp32 masters are DeepSpeed's fp32_groups (the module's weights "
            f"their rounding)")
