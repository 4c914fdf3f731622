"""Checkpoints of a ``hybrid.initialize`` engine: the training script's format, plus the
engine's counters and schedule in metadata.json, and the caller's ``client_state``
in ``client_state.pt`` beside it (:mod:`hybrid.checkpoint.client_state`).

The engine (:class:`hybrid.engine.api.Engine`) is read by its attributes only
(``zero``, ``ps``, ``cfg``, ``rng``, ``lr_scheduler``, ``global_steps``,
``global_samples``, ``micro_steps``, ``train_batch_size()``,
``gradient_accumulation_steps()``, ``module``, ``save_claims``), so this module stays below
the training package.

[Note: one owner per save directory, whichever door]
``save_checkpoint(D)`` claims ``D`` as ``pretrain_gpt.py --save D`` does
(:mod:`hybrid.checkpoint.ownership`): on its first save into ``D`` the engine's rank 0
takes ``D/.lock`` and holds it until it saves elsewhere or :meth:`Engine.close`
(:class:`SaveClaims`), and a directory that holds
another run's checkpoints (``owner.json`` names another run, or none) is refused unless
this engine loaded from it or the save passes ``overwrite=True``; the messages name the
calls, not the flags. Before, an engine's save went over a finished run's
``iter_0000002``, wrote into a directory a live job held, and left ``latest`` naming an
MLP in a GPT run's directory, each with exit 0. The model recorded as the owner's is
the module's parameters (names and shapes, hashed).

[Note: tags]
Without a tag a save is hybrid's ``SAVE/iter_NNNNNNN``, the name
``pretrain_gpt.py`` writes and resumes. A tag (DeepSpeed's ``tag=``, any name
that is one directory) is a directory of its own, ``SAVE/<tag>/``, holding
that tag's newest save in hybrid's layout (``SAVE/<tag>/latest`` and
``SAVE/<tag>/iter_NNNNNNN``; the tag's older saves are pruned), and
``SAVE/latest`` then holds the tag, as DeepSpeed's does. Loading without a tag
follows ``SAVE/latest`` either way (an ``iter_*`` name, or a tag's directory);
``pretrain_gpt.py --load SAVE/<tag>`` resumes a tagged save. A tag that is a
step (``5``, ``"global_step5"``) with no directory of that name loads
``SAVE/iter_0000005``. Every rank writes (and reads) one checkpoint together, so
the tag is rank 0's on every rank; a rank that passed another (DeepSpeed's
getting-started tutorial tags a save with its rank's own ``loss.item()``) is
named in one warning.
"""

from __future__ import annotations

import logging
import os
import re
import zlib

import torch

from hybrid.checkpoint import client_state as client, module_state
from hybrid.checkpoint.async_save import AsyncSaver
from hybrid.checkpoint.files import LATEST, iter_name
from hybrid.checkpoint.integrity import Integrity
from hybrid.checkpoint.load import load_checkpoint
from hybrid.checkpoint.ownership import API, RunIdentity, SaveDirClaim, module_shape
from hybrid.checkpoint.reader import RangeReader
from hybrid.checkpoint.save import finish_save, prepare_save, whole_model_signature
from hybrid.errors import CheckpointError, ConfigError
from hybrid.parallel.agree import agree_error

log = logging.getLogger("hybrid")


def _agreed_tag(ps, tag, where: str, what: str = "tag") -> str | None:
    """Rank 0's ``tag`` (as a string; None for none) on every rank, and one warning on
    rank 0 when some rank passed another (``what``: the argument's name, in it).
    Collective over the world."""
    data = b"" if tag is None else str(tag).encode()
    mine = torch.tensor([-1 if tag is None else len(data), zlib.crc32(data)], dtype=torch.int64,
                        device=ps.device)
    first = mine.clone()
    ps.world_group.broadcast(first, src=0)
    differ = (mine != first).any().to(torch.int64).reshape(1)
    ps.world_group.all_reduce(differ, op=torch.distributed.ReduceOp.MAX)
    n = int(first[0])
    if n < 0:
        agreed = None
    else:
        buf = torch.tensor(list(data) if ps.rank == 0 else [0] * n, dtype=torch.uint8,
                           device=ps.device)
        if n:
            ps.world_group.broadcast(buf, src=0)
        agreed = bytes(buf.cpu().tolist()).decode()
    if int(differ[0]) and ps.rank == 0:
        log.warning("%s(%s=%r): the ranks passed different values; every rank uses rank "
                    "0's, as they write one checkpoint together (pass the same %s on every "
                    "rank)", where, what, agreed, what)
    return agreed


def _tag_name(tag, where: str) -> str:
    """``tag`` as a directory name, or a ValueError saying why it cannot be one."""
    name = str(tag)
    if (not name or name in (".", "..", LATEST) or name.startswith((".", "iter_"))
            or os.sep in name or (os.altsep and os.altsep in name)):
        raise ValueError(f"{where}(tag={tag!r}): a tag names one directory under the "
                         f"checkpoint directory: not empty, no path separator, not starting "
                         f"with '.' or 'iter_' (hybrid's own names), not {LATEST!r}")
    return name


def _write_latest(save_dir: str, name: str) -> None:
    tmp = os.path.join(save_dir, f".{LATEST}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))


def _json_safe(value):
    """``value`` with tensors as numbers or lists and tuples as lists (a scheduler's
    state dict, a group's settings: small, JSON in metadata.json); a callable (a
    LambdaLR's function) as None, as torch's own state dicts leave it out."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if callable(value):
        return None
    return value


def _group_settings(groups: list[dict]) -> list[dict]:
    """Each optimizer group's hyperparameters (its rate, momentum, ...; not its
    parameters): what a scheduler or the caller may have changed since initialize."""
    return [_json_safe({k: v for k, v in g.items() if k != "params"}) for g in groups]


def _restore_group_settings(groups: list[dict], saved: list[dict], only=None) -> None:
    """The saved settings back into the groups (those named in ``only``, or all), each
    in its current type (a tuple of betas, a tensor rate)."""
    if len(saved) != len(groups):
        raise CheckpointError(f"load_checkpoint: the checkpoint's optimizer has {len(saved)} "
                              f"parameter groups, this one {len(groups)}")
    for g, s in zip(groups, saved):
        for k, v in s.items():
            if only is not None and k not in only:
                continue
            old = g.get(k)
            if isinstance(old, torch.Tensor):
                old.fill_(v)
            elif isinstance(old, tuple):
                g[k] = tuple(v)
            else:
                g[k] = v


def _barrier(ps) -> None:
    ps.world_group.all_reduce(torch.zeros(1, device=ps.device))


def _encoded_client_state(ps, client_state: dict) -> bytes | None:
    """Rank 0's ``client_state`` as its file's bytes (None on other ranks), checked to
    load back safely; a ValueError naming the value otherwise, raised on every rank.
    Collective over the world."""
    # Rank 0's is the one saved, as the tag is (and DeepSpeed's rank 0 alone writes the
    # file that holds it when the model is not split), so only rank 0 pays for the check.
    data, error = None, None
    if ps.rank == 0:
        try:
            data = client.encode(client_state)
        except ValueError as e:
            error = str(e)
    error = agree_error(ps, error)  # before any file is touched, on every rank
    if error:
        raise ValueError(error)
    return data


def _encoded_module_state(engine, exclude_frozen: bool):
    """Rank 0's module-state file (:mod:`hybrid.checkpoint.module_state`), None on other
    ranks or when the module has no frozen parameter or buffer; a refusal is raised on
    every rank. Collective over the world."""
    data, error = None, None
    if engine.ps.pp_size > 1:
        # each stage holds its own layers' state, and the file is rank 0's (stage 0's)
        names = module_state.names(engine.module, exclude_frozen)
        if names:
            error = (f"save_checkpoint: {names[0]} of pipeline stage {engine.ps.pp_rank} is a "
                     f"frozen parameter or a buffer, which hybrid does not save for a "
                     f"pipeline engine yet (it would be lost); let it train, make the buffer "
                     f"non-persistent, or pass exclude_frozen_parameters=True if it is a "
                     f"frozen parameter the script rebuilds; nothing was written")
    else:
        # stage 3's partitioned frozen parameters, gathered unit by unit on every rank,
        # kept by rank 0 ([Note: partitioned frozen parameters in the file])
        zero = engine.zero
        whole = (module_state.gather_frozen(zero.frozen_units, zero.param_pipeline,
                                            keep=engine.ps.rank == 0)
                 if not exclude_frozen else {})
        if engine.ps.rank == 0:
            try:
                data = module_state.encode(engine.module, engine.ps.tp_size, exclude_frozen,
                                           gathered=whole)
            except ConfigError as e:
                error = str(e)
    error = agree_error(engine.ps, error)
    if error:
        raise ConfigError(error)
    return data


class SaveClaims:
    """The directory one engine saves into, claimed on its first save there and held until
    it saves elsewhere or :meth:`release` (the Note on owners; rank 0 holds the claim, the
    other ranks None)."""

    def __init__(self, run: RunIdentity):
        self.run = run
        self.loaded: set[str] = set()  # directories the engine loaded from: resumed
        self._held: dict[str, SaveDirClaim | None] = {}

    def record(self, engine, save_dir: str, overwrite: bool) -> dict | None:
        """Collective over the world: claim ``save_dir`` unless this engine holds it;
        the owner record a save writes (rank 0's; None elsewhere). CheckpointError on
        every rank when it is refused."""
        key = os.path.realpath(save_dir)
        if key not in self._held:
            # One held at a time: a Trainer saves each checkpoint into a directory of its
            # own (checkpoint-N), and a lock per save ever made would hold a descriptor
            # each for the run's life. A directory let go stays this run's by owner.json,
            # so a later save there is claimed again without a refusal.
            self.release()
            claim, error = None, None
            if engine.ps.rank == 0:
                try:
                    claim = SaveDirClaim.take(save_dir, self.run, module_shape(engine.module),
                                              resuming=key in self.loaded,
                                              overwrite=overwrite, door=API)
                except CheckpointError as e:
                    error = str(e)
            error = agree_error(engine.ps, error)
            if error:
                raise CheckpointError(error)
            self._held[key] = claim
        claim = self._held[key]
        return None if claim is None else claim.record

    def release(self) -> None:
        """Drop every claim (the engine's end); idempotent."""
        for claim in self._held.values():
            if claim is not None:
                claim.release()
        self._held.clear()


def save_engine(engine, save_dir: str, tag, client_state: dict, save_latest: bool = True,
                overwrite: bool = False, saver: AsyncSaver | None = None,
                exclude_frozen: bool = False) -> str:
    """Collective over the world: write the engine's checkpoint (the module note) with
    rank 0's ``client_state`` (:func:`hybrid.checkpoint.client_state.encode`: any value
    the safe loader takes back, else a ValueError naming it before anything is
    written), into a directory the engine claims (the Note on owners; ``overwrite``:
    another run's checkpoints there are deleted instead of refused); returns its
    directory. ``saver``: write the files on its thread (the engine's, with
    ``checkpoint.writer.decoupled``): the directory is published, and ``latest`` names a
    tag's, when the saver's poll or wait finds every rank done."""
    if saver is not None:
        saver.wait()  # (at most one in flight: the one before is published first)
    data = _encoded_client_state(engine.ps, client_state)
    frozen = _encoded_module_state(engine, exclude_frozen)
    # (a script may name the directory by the clock on each rank, as DeepSpeedExamples'
    # HelloDeepSpeed does: the ranks of one checkpoint write into rank 0's)
    agreed = _agreed_tag(engine.ps, save_dir, "save_checkpoint", "save_dir")
    assert agreed is not None  # (rank 0 passed one)
    save_dir = agreed
    tag = _agreed_tag(engine.ps, tag, "save_checkpoint")
    if tag is None and not save_latest:  # a name of its own, so that latest stays
        tag = f"global_step{engine.global_steps}"
    name = None if tag is None else _tag_name(tag, "save_checkpoint")
    # The client state is a file of its own, not a metadata.json entry, in every save:
    # JSON would turn its tuples into lists and its int keys into strings, and holds no
    # tensors. (Checkpoints from before it hold a JSON "client_state": load_engine reads
    # those still.)
    extra = {"client_state_file": client.FILE,
             "module_state_file": module_state.FILE if frozen else None,
             "module_state_excludes_frozen": exclude_frozen,
             "frozen_parameters": module_state.frozen_names(engine.module),
             "lr_scheduler": (None if engine.lr_scheduler is None
                              else _json_safe(engine.lr_scheduler.state_dict())),
             "optimizer_groups": _group_settings(engine.optimizer.param_groups),
             "optimizer_group_members": engine.group_members,
             "api": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                     "global_samples": engine.global_samples, "tag": name}}
    owner = engine.save_claims.record(engine, save_dir, overwrite)
    target = save_dir if name is None else os.path.join(save_dir, name)
    pending = prepare_save(target, engine.global_steps,
                           engine.global_steps * engine.train_batch_size(), engine.zero,
                           engine.ps, engine.cfg.to_dict(), engine.rng, extra_meta=extra,
                           extra_files=None if data is None else {
                               client.FILE: data, **({module_state.FILE: frozen}
                                                     if frozen else {})},
                           keep_last=None if name is None else 1,
                           owner=owner if name is None else None,
                           snapshot=saver.buffer if saver is not None else False)

    def name_it(path: str) -> None:
        if name is not None and save_latest:
            if engine.ps.rank == 0:
                _write_latest(save_dir, name)
            _barrier(engine.ps)  # no rank reads latest before it names the tag

    if saver is not None:
        saver.start(pending, after=name_it)
        return pending.final
    pending.write()
    path = finish_save(pending, engine.ps)
    name_it(path)
    return path


def _resolve(load_dir: str, tag) -> tuple[str, int | None] | None:
    """(the directory to load the newest save of, or the save of step N in it) for
    ``tag`` under ``load_dir``; None for nothing to load (no tag, and no directory or
    no ``latest`` there)."""
    if tag is None:
        if not os.path.isdir(load_dir):
            return None
        latest = os.path.join(load_dir, LATEST)
        if os.path.isfile(latest):
            with open(latest, encoding="utf-8", errors="replace") as f:
                name = f.read().strip()
            if (name and not os.path.isfile(os.path.join(load_dir, name, "metadata.json"))
                    and os.path.isdir(os.path.join(load_dir, name))):
                return os.path.join(load_dir, name), None  # a tag's directory
        return load_dir, None  # hybrid's names (or nothing: the load says so)
    name = _tag_name(tag, "load_checkpoint")
    if os.path.isdir(os.path.join(load_dir, name)):
        return os.path.join(load_dir, name), None
    step = re.fullmatch(r"(?:global_step)?(\d+)", name)
    if step and os.path.isdir(os.path.join(load_dir, iter_name(int(step.group(1))))):
        return load_dir, int(step.group(1))
    there = sorted(n for n in os.listdir(load_dir) if not n.startswith(".")) if os.path.isdir(
        load_dir) else []
    raise CheckpointError(f"load_checkpoint({load_dir!r}, tag={tag!r}): no checkpoint of that "
                          f"tag there ({'it holds ' + ', '.join(there[:12]) if there else 'empty'}"
                          f"); pass tag=None to load the one 'latest' names")


def load_engine(engine, load_dir: str, tag, optimizer: bool, schedule: bool):
    """Collective: restore the checkpoint ``tag`` names under ``load_dir`` (the module
    note) into the engine; returns (its directory, its client_state), or (None, None)
    when there is none and no ``tag`` was asked for. The client_state is the one rank 0
    saved, on every rank, its tensors on the CPU (as DeepSpeed returns them); a missing,
    damaged or unreadable client-state file is a CheckpointError naming it, raised
    after the weights were loaded and before the engine's counters change."""
    engine.save_claims.loaded.add(os.path.realpath(load_dir))  # a save there resumes
    tag = _agreed_tag(engine.ps, tag, "load_checkpoint")
    peer = _import_peer(engine, load_dir, tag)
    where = peer[:2] if peer is not None else _resolve(load_dir, tag)
    if where is None:
        return None, None
    info: dict = {}
    got = load_checkpoint(where[0], engine.zero, engine.ps, engine.cfg.seed, engine.rng,
                          allow_empty=tag is None and peer is None, load_optim=optimizer,
                          info=info, step=where[1])
    if got is None:
        return None, None
    meta = info["metadata"]
    if peer is not None:  # the peer's counters and schedule, as its engine saved them
        meta = {**meta, "api": peer[2].get("api", {}), "lr_scheduler": peer[2].get(
            "lr_scheduler"), "client_state": peer[2].get("client_state", {})}
    state = _load_client_state(engine.ps, info["checkpoint"], meta)  # (before the counters)
    _load_module_state(engine, info["checkpoint"], meta)
    api = meta.get("api", {})
    steps = api.get("global_steps", meta["iteration"])
    engine.global_steps = steps
    engine.micro_steps = api.get("micro_steps", steps * engine.gradient_accumulation_steps())
    engine.global_samples = api.get("global_samples", meta["consumed_samples"])
    if optimizer and meta.get("optimizer_groups") is not None:
        # a client optimizer's groups as saved; hybrid's AdamW's settings are the config's
        _restore_group_settings(engine.optimizer.param_groups, meta["optimizer_groups"],
                                None if engine.optimizer.client is not None else ("lr",))
    if schedule and meta.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    return info["checkpoint"], state


# [Note: a peer's checkpoint through load_checkpoint]
# engine.load_checkpoint(D) on another framework's save directory (DeepSpeed's, whose
# scripts this door serves; Megatron's, DCP's) imports the peer's tag once as a hybrid
# checkpoint of its own (hybrid.checkpoint.peers.importing: weights, fp32 masters, Adam
# moments, step), into D/hybrid_import/iter_N, and loads that at the engine's layout.
# Nothing of the peer's is changed: its files and its `latest` stay as they are, so the
# peer itself loads D again. A later load of the same tag (a restart) finds the import
# there and reads the peer's files no more. The engine's counters and the scheduler's
# state come from the peer's own record (DeepSpeed: global_steps, global_samples,
# lr_scheduler in its model-state file).
PEER_IMPORT = "hybrid_import"


def _import_peer(engine, load_dir: str, tag: str | None) -> tuple[str, int | None, dict] | None:
    """(the hybrid checkpoint directory, its iteration, the peer's engine record) when
    ``load_dir`` (or its ``tag``) holds another framework's checkpoint (the Note above);
    None otherwise. Collective over the world; errors raised on every rank."""
    from hybrid.checkpoint.peers import detect_peer, open_peer
    from hybrid.checkpoint.peers.importing import import_for_load
    src = load_dir if tag is None else os.path.join(load_dir, tag)
    if not os.path.isdir(src) or os.path.isfile(os.path.join(src, "metadata.json")):
        return None
    fmt = detect_peer(src)
    if fmt is None:
        return None
    # the whole module's names and shapes (a pipeline's gathered over its stages: every
    # rank is here; rank 0 alone opens the peer)
    sig = whole_model_signature(engine.zero.model, engine.ps) if fmt == "deepspeed" else {}

    def module_names(path: str, found: str, step: int | None):
        if found != "deepspeed":
            return open_peer(path, found, step)
        from hybrid.checkpoint.peers import deepspeed, deepspeed_pipe
        tag_dir = deepspeed_pipe.tag_dir_of(path, step)
        if tag_dir is not None and deepspeed_pipe.is_pipeline(tag_dir):
            peer = _open_pipeline(engine, tag_dir)
        else:
            frozen = module_state.frozen_names(engine.module)
            # (the module it trained is ours; a save without ZeRO names no frozen one)
            peer = deepspeed.open(path, step, names="module", frozen=frozen)
            peer.take_excluded({n: sig[n] for n in frozen if n in sig})
        _check_peer_model(peer, sig)  # before anything is written
        return peer
    got = import_for_load(src, os.path.join(load_dir, PEER_IMPORT), engine.ps,
                          engine.cfg.to_dict(), None, fmt, opener=module_names,
                          newest_on_reuse=False)  # (the tag asked for: imports only there)
    if got is None:
        return None
    record: dict = {}
    error = None
    if fmt == "deepspeed":  # every rank reads the one small model-state file itself
        from hybrid.checkpoint.peers.deepspeed import engine_state
        try:
            ds = engine_state(src)
            record = {"api": {"global_steps": ds["global_steps"],
                              "global_samples": ds["global_samples"]},
                      "lr_scheduler": ds["lr_scheduler"], "client_state": ds["client_state"]}
        except CheckpointError as e:
            error = str(e)
    error = agree_error(engine.ps, error)
    if error:
        raise CheckpointError(error)
    return got[0], got[1], record


def _open_pipeline(engine, tag_dir: str):
    """A DeepSpeed pipeline checkpoint (hybrid.checkpoint.peers.deepspeed_pipe), in the
    names of the engine's PipelineModule, whose layer list names its files' entries;
    refused by name into another module."""
    from hybrid.checkpoint.peers import deepspeed_pipe
    if not callable(getattr(engine.module, "checkpoint_layers", None)):  # (a PipelineModule)
        raise CheckpointError(f"{tag_dir}: a DeepSpeed pipeline (PipelineModule) checkpoint "
                              f"(layer_*-model_states.pt): load it with engine.load_checkpoint "
                              f"on hybrid.deepspeed.pipe.PipelineModule, built from the same "
                              f"layers; this engine's module is a "
                              f"{type(engine.module).__name__}")
    return deepspeed_pipe.DeepSpeedPipeline(tag_dir, deepspeed_pipe.layer_prefixes(engine.module))


def _check_peer_model(peer, mine: dict) -> None:
    """CheckpointError naming the peer's file when its parameters are not the engine
    module's (``mine``: the whole module's names and full shapes)."""
    theirs = {**peer.shapes, **peer.frozen_shapes}
    where = getattr(peer, "model_file", peer.path)
    module_state.same_shapes(f"{where}: a checkpoint of another model", theirs, mine,
                             "this engine's module")


def _load_client_state(ps, ckpt: str, meta: dict) -> dict:
    """The client_state saved in checkpoint ``ckpt`` (``meta``: its metadata.json), on
    every rank: its file's, checked against its checksum and loaded safely with tensors
    on the CPU, or the JSON one in metadata.json of a save from before that file.
    CheckpointError naming the file, on every rank. Collective over the world."""
    name = meta.get("client_state_file")
    if name is None:
        return meta.get("client_state", {})
    path = os.path.join(ckpt, str(name))
    # Every rank reads the file itself rather than taking rank 0's bytes by broadcast:
    # it is one small file, read just after metadata.json, which every rank has read
    # too, so at 1,000 ranks a shared filesystem serves it from its cache as it does
    # metadata.json, with no collective sized by the state. Only the outcome is agreed.
    state, error = None, None
    try:
        if os.path.basename(str(name)) != name:
            raise CheckpointError(f"{os.path.join(ckpt, 'metadata.json')}: client_state_file "
                                  f"{name!r} is not a file name (a damaged metadata.json)")
        state = client.decode(Integrity(ckpt, meta).read_file(path, RangeReader()), path)
    except CheckpointError as e:
        error = str(e)
    error = agree_error(ps, error)
    if error:
        raise CheckpointError(error)
    assert state is not None  # (else every rank raised)
    return state


def _load_module_state(engine, ckpt: str, meta: dict) -> None:
    """Put the checkpoint's frozen parameters and buffers back into the engine's module
    (:mod:`hybrid.checkpoint.module_state`; nothing for a save without them), on every
    rank from the file itself, checked against its checksum. CheckpointError naming the
    file, on every rank. Collective over the world."""
    error = None
    try:
        saved = module_state.read(ckpt, meta)
        if saved:
            module_state.restore(engine.module, saved, os.path.join(ckpt, module_state.FILE),
                                 bool(meta.get("module_state_excludes_frozen")),
                                 frozen_units=engine.zero.frozen_units)
    except CheckpointError as e:
        error = str(e)
    error = agree_error(engine.ps, error)
    if error:
        raise CheckpointError(error)
