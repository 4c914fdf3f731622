"""Where a run starts from ``--load``: Megatron's resume, ``--no-load-optim``,
``--no-load-rng`` and ``--finetune``.

=====================  ========  =================  ==========  ==========
flags                  weights   iteration, data    optimizer   RNG
=====================  ========  =================  ==========  ==========
(none)                 loaded    loaded             loaded      loaded
``--no-load-optim``    loaded    loaded             fresh       loaded
``--no-load-rng``      loaded    loaded             loaded      ``--seed``
``--finetune``         loaded    0, from the start  fresh       ``--seed``
=====================  ========  =================  ==========  ==========

"Fresh optimizer": both Adam moments zero, step count 0, the loss scaler as
configured (Megatron keeps the loss scale in the optimizer state). The
learning rate is a function of the iteration (:mod:`hybrid.config.lr_schedule`), so
after ``--no-load-optim`` it continues where the checkpoint was; Megatron
instead restarts its scheduler when the optimizer is not loaded.
A checkpoint saved with ``--no-save-optim`` holds no optimizer state: loading
it without ``--no-load-optim`` or ``--finetune`` is a CheckpointError naming
them, never a silent restart of the moments.

[Note: a finetune run's checkpoints are a series of their own]
``--finetune`` starts at iteration 0, so its saves (``iter_0000050``, ...) must
not mix with the checkpoints it started from: their names could collide (a
save overwrites the same name) and ``latest``/``--keep-last`` would mix the
two runs. Every save of a finetune run records where it started in
metadata.json (``"finetune": {"load", "checkpoint", "iteration"}``), and later
saves of the same run, resumed with or without ``--finetune``, carry it on.
With ``--finetune``, the newest checkpoint in ``--save`` decides:

* none (no ``--save``, or nothing saved there yet): finetune from ``--load``;
* one of a finetune run: this is a restart of that run (torchrun restarts
  with the same command line; ``--load`` equal to ``--save`` after the first
  launch), so resume it exactly as a plain resume would -- optimizer and RNG
  included: ``--no-load-optim`` / ``--no-load-rng`` next to ``--finetune`` are
  about the checkpoint it started from. To finetune a finetuned model again,
  ``--save`` to a new directory;
* one of another run (``--save`` equal to ``--load`` on a pretraining
  directory, or a used directory): a CheckpointError asking for a new
  ``--save`` directory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from hybrid.checkpoint.files import find_checkpoint, read_metadata
from hybrid.checkpoint.load import load_checkpoint
from hybrid.checkpoint.peers.importing import import_for_load
from hybrid.config.sections import CheckpointConfig
from hybrid.errors import CheckpointError
from hybrid.parallel.agree import agree_error
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import TPRNGTracker
from hybrid.zero import ZeroEngine

log = logging.getLogger("hybrid")

# where --finetune imports a peer's --load: a directory of --save's own, hidden from its
# checkpoints (the finetune series starts at iteration 0 beside it)
FINETUNE_IMPORT = ".finetune_import"


@dataclass(frozen=True)
class Start:
    """Where the loaded run goes on from."""

    iteration: int
    consumed_samples: int
    checkpoint: str  # the checkpoint directory loaded
    finetune: dict | None  # what every save of this run records as metadata "finetune"
    buffers: dict | None = None  # the model buffers it saved (metadata "buffers"), if any


def start_from_checkpoint(ck: CheckpointConfig, engine: ZeroEngine, ps: ParallelState,
                          seed: int, rng: TPRNGTracker, vocab_size: int | None,
                          config: dict | None = None, owner: dict | None = None
                          ) -> Start | None:
    """Load what ``ck``'s flags ask for into ``engine`` and ``rng``; None when there is
    nothing to load (no ``--load``, or ``--load`` equal to ``--save`` and empty).

    Collective over the world (see :func:`load_checkpoint`); every error is raised on
    every rank with the same message. ``seed``: ``--seed`` (fresh RNG streams when
    the world layout changed); the flags come from ``ck`` alone. A ``--load`` that holds
    another framework's checkpoint is imported into ``--save`` first
    (:func:`hybrid.checkpoint.peers.importing.import_for_load`; ``config``: the run's
    flat flags, recorded with it; ``owner``: the run's claim on ``--save``).
    """
    if not ck.load:
        return None
    if ck.finetune:
        error, own = None, None
        try:
            own = _own_finetune_checkpoint(ck)
        except CheckpointError as e:
            error = str(e)
        error = agree_error(ps, error)
        if error:
            raise CheckpointError(error)
        if own is None:
            # a peer's checkpoint is imported first, into a directory of its own under
            # --save (the finetune series' iter_N would take its name), then finetuned from
            scratch = os.path.join(ck.save, FINETUNE_IMPORT) if ck.save else None
            imported = import_for_load(ck.load, scratch, ps, config or {}, vocab_size,
                                       None if ck.load_format == "auto" else ck.load_format,
                                       ck.ckpt_step, model=engine.model)
            return _finetune(ck, engine, ps, seed, rng, vocab_size, *(imported or (None,)))
        assert ck.save is not None  # (own is a checkpoint in it)
        load_dir, load_optim, load_rng = ck.save, True, True
    else:
        load_dir, load_optim, load_rng = ck.load, not ck.no_load_optim, not ck.no_load_rng
    step = ck.ckpt_step if load_dir == ck.load else None
    if load_dir == ck.load:
        imported = import_for_load(ck.load, ck.save, ps, config or {}, vocab_size,
                                   None if ck.load_format == "auto" else ck.load_format,
                                   ck.ckpt_step, owner, model=engine.model)
        if imported is not None:  # the peer's iteration, now hybrid's in --save
            load_dir, step = imported
    info: dict = {}
    loaded = load_checkpoint(load_dir, engine, ps, seed, rng, vocab_size,
                             allow_empty=load_dir == ck.save and step is None,
                             load_optim=load_optim, load_rng=load_rng, info=info, step=step)
    if loaded is None:
        return None
    start = Start(loaded[0], loaded[1], info["checkpoint"], info["metadata"].get("finetune"),
                  info["metadata"].get("buffers"))
    fresh = [what for what, on in (("optimizer", not load_optim), ("RNG from --seed",
                                                                   not load_rng)) if on]
    log.info("resumed from %s at iteration %d (%d samples consumed)%s", start.checkpoint,
             start.iteration, start.consumed_samples,
             f"; fresh: {', '.join(fresh)}" if fresh else "")
    if ck.finetune:
        origin = start.finetune
        assert ck.save is not None and origin is not None  # (a finetune run's own checkpoint)
        log.info("--finetune: %s holds this finetune run (started from %s at its iteration "
                 "%d), so it resumes instead of starting over", ck.save, origin["checkpoint"],
                 origin["iteration"])
        if os.path.realpath(origin["load"]) not in (os.path.realpath(ck.load),
                                                    os.path.realpath(ck.save)):
            log.warning("--finetune: the run resumed from --save %s started from %s, not from "
                        "--load %s; give --save a new directory to finetune from --load",
                        ck.save, origin["load"], ck.load)
    return start


def _finetune(ck: CheckpointConfig, engine: ZeroEngine, ps: ParallelState, seed: int,
              rng: TPRNGTracker, vocab_size: int | None, imported: str | None = None,
              step: int | None = None) -> Start:
    """The weights of ``--load``'s newest checkpoint (or of ``imported``, a peer's import
    of it, at ``step``: None for its newest); iteration and samples 0."""
    assert ck.load is not None  # (the caller's condition)
    info: dict = {}
    loaded = load_checkpoint(imported or ck.load, engine, ps, seed, rng, vocab_size,
                             load_optim=False, load_rng=False, info=info,
                             step=step if imported else ck.ckpt_step)
    assert loaded is not None  # (not allow_empty: no checkpoint raises)
    iteration, _ = loaded
    ckpt = info["checkpoint"]
    log.info("finetuning from %s (its iteration %d weights): starting at iteration 0 with a "
             "fresh optimizer, the data from the start and the RNG from --seed", ckpt,
             iteration)
    return Start(0, 0, ckpt, {"load": os.path.abspath(ck.load),
                              "checkpoint": os.path.abspath(ckpt), "iteration": iteration})


def _own_finetune_checkpoint(ck: CheckpointConfig) -> str | None:
    """The newest checkpoint in ``--save`` when it belongs to a finetune run (then this
    launch resumes it), None when ``--save`` has none; CheckpointError when it holds
    another run's checkpoints, or a weights-only one (no exact resume)."""
    if not ck.save or not os.path.isdir(ck.save):
        return None
    ckpt = find_checkpoint(ck.save)
    if ckpt is None:
        return None
    meta = read_metadata(ckpt)
    name = os.path.basename(ckpt)
    if not meta.get("finetune"):
        same = ck.load is not None and os.path.realpath(ck.save) == os.path.realpath(ck.load)
        raise CheckpointError(
            f"--finetune starts a new series of checkpoints at iteration 0, but --save "
            f"{ck.save} already holds {name} of a run not started with --finetune"
            f"{' (it is the --load directory)' if same else ''}: saving there would mix the "
            f"two and overwrite checkpoints of equal iterations; give --save a new directory")
    if meta.get("zero_layout", {}).get("columns") == ["master"]:
        raise CheckpointError(
            f"--save {ck.save} holds this finetune run's {name}, saved with --no-save-optim, "
            f"which cannot resume it exactly: continue it with --load {ck.save} "
            f"--no-load-optim (without --finetune), or give --save a new directory to "
            f"finetune from --load again")
    return ckpt
