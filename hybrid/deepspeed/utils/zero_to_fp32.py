"""``deepspeed.utils.zero_to_fp32``: a saved checkpoint as one full fp32 state dict.

    sd = get_fp32_state_dict_from_zero_checkpoint("ckpt")   # {name: full fp32 tensor}
    model = load_state_dict_from_zero_checkpoint(model, "ckpt")

``checkpoint_dir`` is what ``engine.save_checkpoint`` was given: the save ``latest``
names is read (or ``tag``'s: a tag's directory, or a step, ``5`` / ``"global_step5"``),
each parameter's fp32 master put together from every rank's pieces whatever the ZeRO
stage, DP or TP size that wrote it (:func:`hybrid.checkpoint.reshard.iter_full_params`),
one parameter in memory at a time besides the result. A directory of one save itself
(``ckpt/iter_0000010``) is read as it is. No process group is needed: it runs in any
process, as DeepSpeed's script does. The state dict holds, as DeepSpeed's does, the
module's persistent buffers, its frozen parameters (unless ``exclude_frozen_parameters``,
or the save excluded them) and the parameters the engine trained, under the module's
state-dict names, on the CPU (:mod:`hybrid.checkpoint.module_state` for the first two).
"""

from __future__ import annotations

import os
import re
from typing import NoReturn

import torch
from torch import nn

from hybrid.checkpoint import module_state
from hybrid.checkpoint.files import find_checkpoint, foreign_checkpoint, step_checkpoint
from hybrid.checkpoint.reshard import iter_full_params
from hybrid.deepspeed.missing import refuse
from hybrid.errors import CheckpointError

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"]


def _save_dir(checkpoint_dir: str, tag: object) -> str:
    """The one save's directory ``checkpoint_dir`` and ``tag`` name (module doc)."""
    where = f"get_fp32_state_dict_from_zero_checkpoint({checkpoint_dir!r}, tag={tag!r})"
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{where}: no such directory")
    if os.path.isfile(os.path.join(checkpoint_dir, "metadata.json")):
        return checkpoint_dir  # one save's own directory
    foreign = foreign_checkpoint(checkpoint_dir)
    if foreign is not None:
        raise CheckpointError(f"{where}: it holds a {foreign[0]} checkpoint ({foreign[1]}); "
                              f"hybrid reads the checkpoints its engine saved (for "
                              f"DeepSpeed's own, run the zero_to_fp32.py it saved there)")
    if tag is not None:
        name = str(tag)
        if os.path.isdir(os.path.join(checkpoint_dir, name)):
            return _save_dir(os.path.join(checkpoint_dir, name), None)
        step = re.fullmatch(r"(?:global_step)?(\d+)", name)
        if step is None:
            raise CheckpointError(f"{where}: no save of that tag there")
        return step_checkpoint(checkpoint_dir, int(step.group(1)))
    latest = os.path.join(checkpoint_dir, "latest")
    if os.path.isfile(latest):  # a tagged save: latest names its directory
        with open(latest, encoding="utf-8", errors="replace") as f:
            name = f.read().strip()
        inner = os.path.join(checkpoint_dir, name)
        if name and os.path.isdir(inner) and not name.startswith("iter_"):
            return _save_dir(inner, None)
    found = find_checkpoint(checkpoint_dir)
    if found is None:
        raise CheckpointError(f"{where}: no complete checkpoint there")
    return found


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: object = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False
                                             ) -> dict[str, torch.Tensor]:
    """{parameter name: full fp32 tensor} of the save ``checkpoint_dir`` and ``tag`` name
    (module doc), buffers and frozen parameters first. ``exclude_frozen_parameters``: the
    frozen parameters left out; ``lazy_mode=True`` is refused: the tensors are read whole."""
    if lazy_mode:
        raise CheckpointError("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True): "
                              "hybrid reads the tensors whole; pass lazy_mode=False")
    save = _save_dir(os.fspath(checkpoint_dir), tag)
    meta, params = iter_full_params(save, ("master",))
    frozen = set(meta.get("frozen_parameters") or ())
    out = {n: t for n, t in module_state.read(save, meta).items()
           if not (exclude_frozen_parameters and n in frozen)}
    out.update((name, values["master"]) for name, values in params)
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str,
                                         tag: object = None) -> nn.Module:
    """``model`` on the CPU with the saved fp32 values loaded (``strict=False``: frozen
    parameters keep theirs), as DeepSpeed's returns it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag),
                          strict=False)
    return model


def __getattr__(name: str) -> NoReturn:
    why = ("save the state dict yourself: torch.save(get_fp32_state_dict_from_zero_checkpoint"
           "(checkpoint_dir), path)" if name.startswith("convert_") else
           "it holds get_fp32_state_dict_from_zero_checkpoint and "
           "load_state_dict_from_zero_checkpoint")
    refuse("utils.zero_to_fp32", name, why)
