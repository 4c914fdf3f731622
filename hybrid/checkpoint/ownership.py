"""A ``--save`` directory belongs to one run: an exclusive lock and an ownership record.

    claim = SaveDirClaim.take(save_dir, run, model, resuming=..., overwrite=...)
    save_checkpoint(..., owner=claim.record)   # each save records the run as the owner
    claim.release()                            # the lock drops

[Note: what a claim refuses]
Without an owner, two jobs given the same ``--save`` overwrite each other's
``iter_N`` and both exit 0, and a new run started on a used directory replaces
another run's checkpoints. So rank 0 of a run that saves, before anything else:

* takes an ``flock`` on ``SAVE/.lock`` (as the nvme tier's swap directory does)
  and writes who holds it there (host, pid, start time): a second job on the
  directory is refused, naming the holder. The kernel drops the lock when its
  holder dies, so a SIGKILLed job leaves no stuck lock, only its words in the
  file (a clean release empties it): that is how the next run knows to say it
  took over a dead job's directory;
* reads ``SAVE/owner.json``, the record of the run whose checkpoints the
  directory holds, and refuses a run that would write over another run's
  checkpoints: the directory holds complete checkpoints, this run does not
  resume from it (``--load`` elsewhere or none), and the record names another
  run (or there is none: an older hybrid, a copied directory). The message says
  the three ways on: ``--load`` the same directory to resume,
  ``--overwrite-save`` (or another directory) to start over, ``--finetune`` to
  start from its weights.

A run becomes the owner when it saves: every save writes ``owner.json`` (run
identity, host, pid, start time, model shape) with its checkpoint, so a run
that fails before saving leaves the directory exactly as it found it.

"Another run" is another :class:`RunIdentity`. The identity is the launch's
(torchrun's run id and the launch time), so a worker restarted by ``torchrun
--max-restarts`` is the same run and finds its own checkpoints acceptable,
with or without ``--load``. Resuming (``--load`` equal to ``--save``) is
always allowed and says nothing. ``--finetune`` has its own rule for its
``--save`` (:mod:`hybrid.checkpoint.resume`) and is left to it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from hybrid.checkpoint.files import LATEST, complete_checkpoints, foreign_checkpoint
from hybrid.config.sections import CheckpointConfig
from hybrid.errors import CheckpointError
from hybrid.parallel.agree import agree_error
from hybrid.parallel.state import ParallelState

OWNER = "owner.json"
LOCK = ".lock"
# written by an import of another framework's checkpoint (hybrid/checkpoint/peers/importing.py):
# {"load": the --load directory it came from}. A later run with the same --load and --save
# resumes this directory's run, as --load equal to --save does.
IMPORTED = "imported_from.json"


def imported_from(save_dir: str) -> str | None:
    """The ``--load`` directory ``save_dir``'s checkpoints were imported from (realpath), or
    None."""
    try:
        with open(os.path.join(save_dir, IMPORTED), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    load = record.get("load") if isinstance(record, dict) else None
    return load if isinstance(load, str) else None

# The flags that fix a model's parameter shapes: what the ownership record's "model"
# holds and compares (a checkpoint of other values is a checkpoint of another model).
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
               "num_query_groups", "group_query_attention", "max_position_embeddings",
               "position_embedding_type", "swiglu", "normalization",
               "untie_embeddings_and_output_weights", "disable_bias_linear", "add_qkv_bias",
               "tokenizer_type", "vocab_size", "make_vocab_size_divisible_by")
# Shape flags added later: part of the record only when set, so the fingerprint of every
# model without them (every record written before they existed) stays what it was.
SHAPE_FLAGS_WHEN_SET = ("kv_channels", "qk_layernorm")

log = logging.getLogger("hybrid")


@dataclass(frozen=True)
class RunIdentity:
    """Who is running: ``id`` is the same for every process and restart of one launch."""

    id: str
    host: str
    pid: int
    started: float  # epoch seconds

    @classmethod
    def of_launch(cls, environ: Mapping[str, str] | None = None) -> RunIdentity:
        """This process's identity, from the entry point's ``environ``: under torchrun
        the launch's (its run id, and the agent -- this worker's parent -- by host and
        pid, which a restarted worker shares); otherwise, or with no ``environ``, a
        launch of its own."""
        host, pid, now = socket.gethostname(), os.getpid(), time.time()
        launch = (environ or {}).get("TORCHELASTIC_RUN_ID")
        run_id = (f"torchrun {launch} (agent {host}:{os.getppid()})" if launch else
                  f"{host}:{pid}:{uuid.uuid4().hex[:12]}")
        return cls(run_id, host, pid, now)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, started {when}"


def model_shape(config: dict) -> dict:
    """The shape flags of a run's flat config (:data:`SHAPE_FLAGS`, and those of
    :data:`SHAPE_FLAGS_WHEN_SET` that are set) and their hash."""
    fields = {k: config.get(k) for k in SHAPE_FLAGS}
    fields |= {k: config[k] for k in SHAPE_FLAGS_WHEN_SET if config.get(k)}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return {"fingerprint": digest, "fields": fields}


def module_shape(module) -> dict:
    """A ``hybrid.initialize`` engine's model, as :func:`model_shape` gives a GPT's: its
    parameters' names and shapes, hashed, and their count (any ``nn.Module``)."""
    named = [(n, list(p.shape)) for n, p in module.named_parameters()]
    digest = hashlib.sha256(json.dumps(named).encode()).hexdigest()[:16]
    return {"fingerprint": digest,
            "fields": {"parameters": sum(math.prod(s) for _, s in named),
                       "tensors": len(named)}}


@dataclass(frozen=True)
class Door:
    """How a claim's messages name the directory and the ways on: ``pretrain_gpt.py``'s
    flags (:data:`FLAGS`) or the API engine's calls (:data:`API`). ``{d}``: the directory."""

    where: str
    resume: str
    fresh: str
    overwrite: str
    writable: str
    another: str
    finetune: str = ""


FLAGS = Door(where="--save {d}", resume="add --load {d}",
             fresh="give --save a new directory or add --overwrite-save (which deletes them)",
             overwrite="--overwrite-save", writable="give --save a directory this job can write",
             another="give this job another --save directory",
             finetune="; to start from its weights use --finetune --load {d} with a new --save")
API = Door(where="save_checkpoint({d!r})", resume="call load_checkpoint({d!r}) before saving",
           fresh="save to a new directory or pass save_checkpoint(..., overwrite=True) (which "
                 "deletes them)",
           overwrite="save_checkpoint(overwrite=True)",
           writable="save to a directory this job can write",
           another="save this job's checkpoints to another directory")


def claim_save_dir(ck: CheckpointConfig, ps: ParallelState, run: RunIdentity,
                   config: dict) -> SaveDirClaim | None:
    """Rank 0 claims ``--save`` for ``run`` (:meth:`SaveDirClaim.take`; ``config``: the
    run's flat flags, for its model shape); None on the other ranks and without
    ``--save``. Collective over the world: a refusal is raised on every rank."""
    if not ck.save:
        return None
    claim, error = None, None
    if ps.rank == 0:
        # resuming: --load is --save, or the peer checkpoint --save's run was imported from
        resuming = ck.load is not None and os.path.realpath(ck.load) in (
            os.path.realpath(ck.save), imported_from(ck.save))
        try:
            _refuse_peer_save_dir(ck.save)
            claim = SaveDirClaim.take(ck.save, run, model_shape(config), resuming=resuming,
                                      overwrite=ck.overwrite_save, check_others=not ck.finetune)
        except CheckpointError as e:
            error = str(e)
    error = agree_error(ps, error)
    if error:
        raise CheckpointError(error)  # (rank 0 took nothing: only it can fail)
    return claim


def _refuse_peer_save_dir(directory: str) -> None:
    """CheckpointError when ``--save`` holds another framework's checkpoint and none of
    hybrid's: hybrid's saves would replace its ``latest`` (DeepSpeed's name too) or take
    its ``iter_N`` names (Megatron-LM's), so the peer could no longer load it."""
    if not os.path.isdir(directory) or complete_checkpoints(directory):
        return  # (a directory hybrid saved into already is hybrid's)
    found = foreign_checkpoint(directory)
    if found is not None:
        raise CheckpointError(f"--save {directory} holds a {found[0]} checkpoint "
                              f"({found[1]}): hybrid's saves there would overwrite its "
                              f"files; give --save a new directory")


# [Note: one lock per process]
# An flock belongs to an open file, so a second open of SAVE/.lock in the process that holds
# it conflicts with the first exactly as another job's would. Two claims of one directory
# in one process (two engines of one script, a test's engine and the fresh one it resumes
# into) are not two jobs: the second shares the first's lock, and is still held to the
# ownership record (another run's checkpoints are refused to it as to anyone).
_HELD_HERE: set[str] = set()  # realpaths of the save directories this process has locked


class SaveDirClaim:
    """Rank 0's hold on a ``--save`` directory (see the module notes)."""

    def __init__(self, directory: str, fd: int | None, record: dict):
        self.directory, self._fd, self.record = directory, fd, record
        self._key: str | None = None  # in _HELD_HERE while this claim holds the lock

    @classmethod
    def take(cls, directory: str, run: RunIdentity, model: dict, *, resuming: bool,
             overwrite: bool = False, check_others: bool = True,
             door: Door = FLAGS) -> SaveDirClaim:
        """Lock ``directory`` for ``run`` (created if need be) and record it as the owner.

        ``model``: :func:`model_shape` of the run. ``resuming``: the run loads from this
        directory. ``overwrite`` (``--overwrite-save``): another run's checkpoints here
        are deleted instead of refused. ``check_others`` False: only lock and record
        (``--finetune``, which decides about its ``--save`` itself). CheckpointError
        (naming the directory and the flag) when it is not writable, held by a live
        job, or holds another run's checkpoints. ``door``: whose words the messages use.
        """
        where = door.where.format(d=directory)
        key = os.path.realpath(directory)
        if key in _HELD_HERE:  # this process holds the lock already: share it (the Note)
            claim = cls(directory, None, {"run": run.id, **{
                k: v for k, v in asdict(run).items() if k != "id"}, "model": model})
            if check_others and not resuming:
                _check_others(directory, _read_record(directory), run, model, overwrite, door)
            return claim
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(f"{where}: cannot write there ({e.strerror or e}); "
                                  f"{door.writable}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise CheckpointError(f"{where} is in use by another job ({holder}): two jobs "
                                  f"saving there would overwrite each other's checkpoints; "
                                  f"{door.another}, or stop that one first") from None
        except OSError as e:  # a filesystem without flock (ENOLCK, EOPNOTSUPP)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise CheckpointError(f"{where}: cannot lock it ({e.strerror})") from None
            log.warning("warning: %s cannot be locked on this filesystem (%s); only the "
                        "ownership record guards it", where, e.strerror)
        claim = cls(directory, fd, {})
        try:
            dead = _holder_record(fd)
            if dead is not None and dead.get("run") != run.id:
                # its holder never released it: killed, or its node lost (a restarted
                # worker of this same run is not news: the launcher said who died)
                log.warning("%s: taking it over from a job that ended without releasing it "
                            "(%s)", where, _describe(dead))
            claim.record = {"run": run.id, **{k: v for k, v in asdict(run).items()
                                              if k != "id"}, "model": model}
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(claim.record).encode(), 0)
            except OSError as e:
                raise CheckpointError(f"{where}: cannot write there ({e.strerror or e}); "
                                      f"{door.writable}") from None
            if check_others and not resuming:
                _check_others(directory, _read_record(directory), run, model, overwrite, door)
        except BaseException:
            claim.release()
            raise
        _HELD_HERE.add(key)
        claim._key = key
        return claim

    def release(self) -> None:
        """Drop the lock, leaving ``.lock`` empty (a clean end); idempotent."""
        if self._key is not None:
            _HELD_HERE.discard(self._key)
            self._key = None
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass  # (the next run then says it took over: harmless)
        finally:
            os.close(self._fd)  # (closing the descriptor drops the flock)
            self._fd = None


def _check_others(directory: str, previous: dict | None, run: RunIdentity, model: dict,
                  overwrite: bool, door: Door) -> None:
    """Refuse (or, with ``overwrite``, delete) another run's checkpoints in ``directory``."""
    names = complete_checkpoints(directory)
    if not names or (previous is not None and previous.get("run") == run.id):
        return  # nothing to lose, or this run's own (a torchrun restart)
    if overwrite:
        for name in names:
            shutil.rmtree(os.path.join(directory, name))
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, LATEST))
        log.warning("%s: deleted %d checkpoint(s) of another run in %s (%s to %s)",
                    door.overwrite, len(names), directory, names[0], names[-1])
        return
    whose = (f"a run of {_describe(previous)}" if previous else
             "a run that left no ownership record")
    shape = _shape_difference(previous, model)
    raise CheckpointError(
        f"{door.where.format(d=directory)} already holds checkpoints of another run "
        f"({names[-1]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}, {whose}"
        f"{shape}), and this run would overwrite them: to continue that run "
        f"{door.resume.format(d=directory)}; to start over {door.fresh}"
        f"{door.finetune.format(d=directory)}")


def _shape_difference(previous: dict | None, model: dict) -> str:
    old = (previous or {}).get("model") or {}
    if not old or old.get("fingerprint") == model["fingerprint"]:
        return ""
    diff = [f"{k} {v!r} there, {model['fields'].get(k)!r} here"
            for k, v in (old.get("fields") or {}).items() if model["fields"].get(k) != v]
    return f"; a different model: {', '.join(diff[:3])}" if diff else "; a different model"


def _describe(record: dict) -> str:
    started = record.get("started")
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
            if isinstance(started, (int, float)) else "?")
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, started {when}"


def _holder_record(fd: int) -> dict | None:
    """What the holder (or last, unreleased holder) of the lock wrote into ``.lock``."""
    try:
        data = os.pread(fd, 4096, 0)
        record = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return {}  # something unreadable: a holder all the same
    return record if isinstance(record, dict) or record is None else {}


def _read_holder(fd: int) -> str:
    """Who holds the lock, in words."""
    record = _holder_record(fd)
    return _describe(record) if record else "a job that has not said who it is"


def write_owner(directory: str, record: dict) -> None:
    """Record ``record`` (a claim's) as the owner of ``directory``'s checkpoints; OSError
    for the caller (a save) to report."""
    _write_record(directory, record)


def _read_record(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, OWNER), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_record(directory: str, record: dict) -> None:
    """Replace ``owner.json`` atomically (a crash leaves the old record or the new one)."""
    tmp = os.path.join(directory, f".{OWNER}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, OWNER))
