"""What a ``hybrid.initialize`` engine's checkpoint holds beside its ZeRO units: the
module's frozen parameters and persistent buffers, by name, in one file.

[Note: state outside the units]
A ZeRO unit holds the parameters that train (their fp32 masters and moments); a frozen
parameter (``requires_grad`` False: a pretrained part a script freezes before
``initialize``) is in no unit and stays whole on every rank, and a persistent buffer
(a BatchNorm's running statistics) is no parameter at all. Neither was written: a
resumed run kept whatever its module held before the load, a silent difference from
the run that saved (DeepSpeed's model-state file carries both). Rank 0 now writes them
whole into ``module_state.pt`` beside metadata.json (one of its checksummed
``extra_files``), and every rank puts them back by name after the units are loaded; a
name or shape the module does not have is one CheckpointError naming the file. Every
rank reads the file itself, as it reads metadata.json: the bytes are the frozen part's
once per rank, which every rank holds whole anyway (DeepSpeed's ranks each read its
whole module file too), and no collective is sized by them. Neither side holds a
second copy of a frozen base: the save streams the module's own tensors into the file
(``torch.save`` to it, the checksum taken as the bytes pass), the load checks the file
in 8 MiB reads and maps it, copying each tensor into its place. A save made before
this file existed loads as before, leaving the module's own values.

[Note: partitioned frozen parameters in the file]
At ZeRO stage 3 the frozen parameters are partitioned over DP (hybrid/zero/units.py,
[Note: frozen units]): no rank holds them whole, yet the file keeps its format (whole
tensors by name, in the training dtype), so it loads at any stage and DP size, and a
peer's import or ``zero_to_fp32`` reads it as before. The save gathers the frozen units
one at a time (every rank: they are all-gathers; the device holds one unit whole at a
time) and rank 0 copies each into host memory before releasing it
(:func:`gather_frozen`): rank 0's host then holds the frozen base once while the file
is written -- O(frozen model) on one host, the price of one file every reader knows;
a file per rank of its shards would grow with the work only, and is not done. The load
is every rank's own, as before, and copies only this rank's shard of each frozen unit
out of the mapped file (:func:`restore`), so no rank's device holds a frozen parameter
whole; under ``--offload-param`` that shard goes to the unit's home (host memory or
params.swp: hybrid/zero/offload/tiers.py, [Note: frozen units at home]) and the
device keeps none of it. The save's gathers load each shard from its home.

``save_checkpoint(exclude_frozen_parameters=True)`` (DeepSpeed's flag, which Hugging
Face's Trainer passes for a PEFT model) writes the buffers only: the frozen parameters
are the script's to rebuild (a pretrained base loaded again), and the checkpoint says
so (metadata ``module_state_excludes_frozen``), so its load keeps the module's own.

A frozen parameter or buffer split over tensor parallelism (a ``tp_spec``) would be
saved as rank 0's slice, and a pipeline engine's stages each hold their own: the save
refuses both by name rather than write a part (a pipeline's module state is not saved
yet).
"""

from __future__ import annotations

import os

import torch

from hybrid.checkpoint.integrity import Integrity
from hybrid.errors import CheckpointError, ConfigError

FILE = "module_state.pt"


def _untrained(module: torch.nn.Module, frozen: bool = True) -> dict[str, torch.Tensor]:
    """The module's state-dict entries no optimizer trains, by state-dict name (a tied
    parameter's every name counts as trained); ``frozen`` False: the buffers only."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return {n: t for n, t in module.state_dict(keep_vars=True).items()
            if not (n in params and (params[n].requires_grad or not frozen))}


def names(module: torch.nn.Module, exclude_frozen: bool = False) -> list[str]:
    """What :func:`encode` would write, by name (the buffers only with ``exclude_frozen``)."""
    return list(_untrained(module, frozen=not exclude_frozen))


def frozen_names(module: torch.nn.Module) -> list[str]:
    """The module's frozen parameters' names (``requires_grad`` False)."""
    return [n for n, p in module.named_parameters(remove_duplicate=False)
            if not p.requires_grad]


@torch.no_grad()
def gather_frozen(units, pipe, keep: bool) -> dict[int, torch.Tensor]:
    """Every partitioned frozen parameter of ``units`` (a stage-3 engine's
    ``frozen_units``) whole, by ``id``, as a CPU copy where ``keep`` (rank 0), else {}:
    each unit gathered through ``pipe`` and released again unless it was whole already
    ([Note: partitioned frozen parameters in the file]). Collective over each unit's
    group, in the units' order."""
    out: dict[int, torch.Tensor] = {}
    for u in units:
        was = u.gathered
        u.finish_gather(pipe)
        if keep:
            for p in u.params:
                out[id(p)] = p.detach().to("cpu", copy=True)
        if not was:
            u.release()
    return out


def encode(module: torch.nn.Module, tp_size: int, exclude_frozen: bool = False,
           gathered: dict[int, torch.Tensor] | None = None):
    """The file, as a function writing it to a binary file (:func:`writer`): every frozen
    parameter (none with ``exclude_frozen``) and persistent buffer of ``module``, whole
    (None when there is none). The buffers are copied now (a step may move them before
    an asynchronous save writes); the frozen parameters, which no step moves, are
    written from the module's own tensors, so the save holds no second copy of a frozen
    base. ``gathered``: the partitioned frozen parameters' whole values by ``id``
    (:func:`gather_frozen`), written instead of the module's tensors, which hold only a
    shard. ConfigError naming one split over TP (``tp_size`` > 1)."""
    state = _untrained(module, frozen=not exclude_frozen)
    if not state:
        return None
    if tp_size > 1:
        split = [n for n, t in state.items() if getattr(t, "tp_spec", None) is not None]
        if split:
            raise ConfigError(f"save_checkpoint: {split[0]} is frozen (or a buffer) and split "
                              f"over tensor parallelism; hybrid saves the module's frozen "
                              f"parameters and buffers whole from rank 0: let it train, or "
                              f"keep it whole on every TP rank")
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    whole = gathered or {}
    return writer({n: whole[id(t)] if id(t) in whole else
                   t.detach() if n in params else t.detach().clone()
                   for n, t in state.items()})


def writer(state: dict[str, torch.Tensor]):
    """The function that writes ``state`` (name -> tensor) as the file into a binary file
    (``torch.save``, each tensor's bytes streamed from its storage, on the CPU): what
    :func:`encode` saves, and what an import writes for a peer's module
    (:func:`hybrid.checkpoint.peers.importing.import_peer`)."""
    def write(f) -> None:
        torch.save({n: t if t.device.type == "cpu" else t.cpu() for n, t in state.items()}, f)
    return write


def read(ckpt: str, meta: dict) -> dict[str, torch.Tensor]:
    """The module-state file of checkpoint ``ckpt`` (``meta``: its metadata.json), checked
    against its checksum and loaded safely, its tensors mapped from the file (on the
    CPU; copied where they are put back); {} for a save without one. CheckpointError
    naming the file."""
    path = file_in(ckpt, meta)
    if path is None:
        return {}
    Integrity(ckpt, meta).check_file(path)  # (in 8 MiB reads: never whole in memory)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # (any unpickling failure: a damaged file)
        raise CheckpointError(f"{path}: does not load ({type(e).__name__}: {e})") from None
    if not isinstance(saved, dict) or not all(isinstance(t, torch.Tensor)
                                              for t in saved.values()):
        raise CheckpointError(f"{path}: holds a {type(saved).__name__}, not the frozen "
                              f"parameters and buffers by name")
    return saved


@torch.no_grad()
def restore(module: torch.nn.Module, saved: dict[str, torch.Tensor], path: str,
            excludes_frozen: bool = False, frozen_units=()) -> None:
    """Copy ``saved`` (:func:`read` from ``path``) into ``module``'s frozen parameters and
    buffers of the same names (its buffers only when the save ``excludes_frozen``: the
    module keeps its own frozen values). ``frozen_units``: a stage-3 engine's
    partitioned frozen units, whose parameters take only this rank's shard of their
    values ([Note: partitioned frozen parameters in the file]). CheckpointError naming
    ``path`` when the names or shapes are not the module's."""
    mine = _untrained(module, frozen=not excludes_frozen)
    same_shapes(f"{path}: frozen parameters and buffers of another module",
                {n: list(t.shape) for n, t in saved.items()},
                {n: list(t.shape) for n, t in mine.items()}, "this module")
    name_of = {id(t): n for n, t in mine.items()}
    partitioned: set[int] = set()
    for u in frozen_units if not excludes_frozen else ():
        shard = torch.zeros(u.shard_size, dtype=u.shard.dtype)  # (padding: zeros, as bound)
        for i, plo, ulo, n in u.segments(u.own_lo, u.own_hi):
            a = ulo - u.own_lo
            shard[a: a + n].copy_(saved[name_of[id(u.params[i])]].reshape(-1)[plo: plo + n])
        u.write_shard(shard)  # (to its home under --offload-param: the device keeps none)
        partitioned.update(id(p) for p in u.params if not u.gathered)
    for name, t in mine.items():
        if id(t) not in partitioned:  # (a gathered unit's whole view too)
            t.copy_(saved[name])


def same_shapes(what: str, theirs: dict[str, list[int]], mine: dict[str, list[int]],
                owner: str) -> None:
    """CheckpointError ``what`` and the first names one side has and the other lacks, or
    the first name whose shape differs (``owner``: who "mine" are, in the message)."""
    if set(theirs) != set(mine):
        raise CheckpointError(f"{what}: it has {sorted(set(theirs) - set(mine))[:3]} "
                              f"{owner} lacks, lacks {sorted(set(mine) - set(theirs))[:3]}")
    for name, shape in mine.items():
        if list(theirs[name]) != list(shape):
            raise CheckpointError(f"{what}: {name} is {list(theirs[name])} there and "
                                  f"{list(shape)} in {owner}")


def file_in(ckpt: str, meta: dict) -> str | None:
    """The module-state file of checkpoint ``ckpt`` (``meta``: its metadata.json), or None
    for a save without one. CheckpointError when metadata names something else."""
    name = meta.get("module_state_file")
    if name is None:
        return None
    if name != FILE:
        raise CheckpointError(f"{os.path.join(ckpt, 'metadata.json')}: module_state_file "
                              f"{name!r} is not {FILE!r} (a damaged metadata.json)")
    return os.path.join(ckpt, FILE)
