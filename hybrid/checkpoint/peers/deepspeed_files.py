"""DeepSpeed 0.19.8's checkpoint files: their names, their pickles loaded without DeepSpeed, and
where each parameter's elements are in the flat ZeRO partitions; shared by the reader
(:mod:`.deepspeed`) and the writer (:mod:`.deepspeed_export`).

[Note: DeepSpeed's files, as 0.19.8 writes them]
A save directory holds ``latest`` (the tag, ``global_stepN``) and one directory per tag:

* ZeRO 0-2: ``mp_rank_00_model_states.pt``; ZeRO 3: one ``zero_pp_rank_R_mp_rank_00_
  model_states.pt`` per DP rank (its ``module`` holds empty placeholders). Every one holds
  ``param_shapes`` (a list, one ordered ``{name: torch.Size}`` per optimizer group: the
  order the flat buffers follow), ``global_steps``, ``global_samples``,
  ``lr_scheduler`` (the scheduler's state dict), ``dp_world_size``, ``mp_world_size``,
  ``ds_version``, ``ds_config`` and the caller's client state.
* ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per DP rank R, its
  ``optimizer_state_dict``:

  - stages 1 and 2: group g's parameters are laid end to end (each followed by
    ``param_alignment_paddings[g][i]`` zeros) in one flat buffer, padded at its end to
    ``partition_count * P`` elements, and rank R holds elements ``[R*P, (R+1)*P)``:
    ``single_partition_of_fp32_groups[g]`` (the fp32 masters, saved *without* the
    rank's end padding, ``group_paddings[g]`` elements) and
    ``base_optimizer_state["state"][g]`` (torch's Adam state of that flat tensor:
    ``exp_avg``, ``exp_avg_sq`` *with* the padding, and ``step``);
    ``param_slice_mappings[g]`` names each parameter's ``(start, numel)`` in the rank's
    partition (checked against the layout computed here);
  - stage 3: every parameter is split on its own: padded to a multiple of the world size
    W, rank R holds its elements ``[R*q, (R+1)*q)``, ``q = ceil(numel / W)``; a rank's
    ``fp32_flat_groups`` (one per sub-group) hold its pieces of every parameter end to end
    in ``param_shapes`` order, and ``optimizer_state_dict["state"][s]`` the Adam state of
    sub-group s's flat tensor (same shape).

The pickles name three DeepSpeed classes (``ZeroStageEnum``, ``LossScaler``,
``fragment_address``): they are loaded with torch's weights-only loader, each class
replaced by a plain stand-in, so neither DeepSpeed nor an arbitrary pickle runs here.
Tensors are memory-mapped, and a rank's optimizer file is opened only when a parameter
read needs its partition.
"""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hybrid.errors import CheckpointError

FORMAT = "DeepSpeed"
LATEST = "latest"
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
COLUMNS = ("master", "exp_avg", "exp_avg_sq")


# -- loading DeepSpeed's pickles without DeepSpeed ------------------------------------------

class ZeroStage(int, enum.Enum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an int)."""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class Record:
    """Stand-in for a DeepSpeed object pickled by its attributes (a loss scaler, a
    fragment address): its ``__dict__`` is what was saved."""


class LossScaler(Record):
    pass


class DynamicLossScaler(Record):
    pass


class FragmentAddress(Record):
    pass


STANDINS: list = [(ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
             (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
             (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
             (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address")]


def load_file(path: str, want: type | tuple[type, ...] = dict):
    """One of DeepSpeed's ``.pt`` files, its tensors memory-mapped (weights-only, the
    DeepSpeed classes as stand-ins), holding a ``want`` (a dict: most files);
    CheckpointError naming the file otherwise."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes): a truncated {FORMAT} "
                              f"checkpoint file")
    try:
        with torch.serialization.safe_globals(STANDINS):
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable {FORMAT} checkpoint file (truncated "
                              f"or damaged: {why[:200]})") from None
    if not isinstance(state, want):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not what a {FORMAT} "
                              f"checkpoint holds there")
    return state


def need(state: dict, key: str, path: str):
    if key not in state:
        raise CheckpointError(f"{path}: no {key!r} in it: not a {FORMAT} checkpoint file of "
                              f"a version hybrid reads (0.19.x)")
    return state[key]


# -- the layout of the flat partitions ------------------------------------------------------

@dataclass
class Piece:
    """Elements ``[start, start+numel)`` of a parameter's flattened full tensor are at
    ``[offset, offset+numel)`` of flat tensor ``group`` of DP rank ``rank``'s file."""
    rank: int
    group: int
    offset: int
    start: int
    numel: int


@dataclass
class Layout:
    """Where every parameter's elements are in the ranks' flat tensors."""
    stage: int
    world: int
    pieces: dict[str, list[Piece]] = field(default_factory=dict)


def layout_12(groups: Sequence[Mapping[str, Sequence[int]]], world: int, part: list[int],
               paddings: list[list[int]] | None) -> Layout:
    """Stages 1 and 2: group g's flat buffer, partition ``part[g]`` elements a rank."""
    lay = Layout(2, world)
    for g, shapes in enumerate(groups):
        pos = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n, done = math.prod(shape), 0
            while done < n:
                rank, off = divmod(pos + done, part[g])
                take = min(n - done, part[g] - off)
                lay.pieces.setdefault(name, []).append(Piece(rank, g, off, done, take))
                done += take
            pos += n + (paddings[g][i] if paddings else 0)
        if pos > world * part[g]:
            raise ValueError(f"group {g}: {pos} elements do not fit {world} partitions of "
                             f"{part[g]}")
    return lay


def layout_3(groups: Sequence[Mapping[str, Sequence[int]]], world: int,
              sub: list[int]) -> Layout:
    """Stage 3: each parameter split W ways; ``sub``: the sizes of a rank's flat
    sub-group tensors, which hold its pieces end to end."""
    lay = Layout(3, world)
    bounds = [0]
    for s in sub:
        bounds.append(bounds[-1] + s)
    pos = 0
    for shapes in groups:
        for name, shape in shapes.items():
            n = math.prod(shape)
            q = -(-n // world)
            for rank in range(world):
                lo, hi = rank * q, min(n, (rank + 1) * q)
                at = pos
                while lo < hi:  # (a piece may straddle two sub-groups)
                    s = max(i for i in range(len(sub)) if bounds[i] <= at)
                    take = min(hi - lo, bounds[s + 1] - at)
                    if take <= 0:
                        raise ValueError(f"{name}: past the end of the flat tensors")
                    lay.pieces.setdefault(name, []).append(
                        Piece(rank, s, at - bounds[s], lo, take))
                    lo, at = lo + take, at + take
            pos += q
    if pos != bounds[-1]:
        raise ValueError(f"the parameters take {pos} elements a rank, the flat tensors "
                         f"hold {bounds[-1]}")
    return lay

