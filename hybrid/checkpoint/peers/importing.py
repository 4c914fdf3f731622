"""A peer checkpoint written as a hybrid checkpoint, which every hybrid load then reads.

[Note: import by conversion]
A peer's files are laid out for the peer's layout (DeepSpeed's flat ZeRO partitions,
Megatron's sharded tensors, DCP's chunks), and a hybrid run may take any other. Rather
than teach every load path (resharding, experts, the vocabulary's padding, pipeline
stages, offload tiers) each peer's files, the import writes the peer's iteration once as
a hybrid checkpoint of one rank holding every parameter whole -- weights, fp32 masters,
Adam moments, step count, iteration, consumed samples -- and the ordinary load reshards
it to the run's layout. Memory holds one parameter at a time; the bytes written equal
the model's state once. The hybrid checkpoint is an ``iter_N`` of the run's ``--save``
directory (the peer's iteration, so the learning rate continues where it was): a
restart of the same command finds it there and resumes from ``--save`` without reading
the peer again. ``--load`` writes nothing into the peer's directory; ``engine.load_checkpoint``,
which has no ``--save``, writes the import into ``hybrid_import/`` under it (beside the
peer's own files, none of which changes: its ``latest`` names the peer's tag still).
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch

from hybrid.checkpoint import module_state
from hybrid.checkpoint.files import complete_checkpoints, iter_name, read_metadata
from hybrid.checkpoint.load import check_model
from hybrid.checkpoint.ownership import IMPORTED, write_owner
from hybrid.checkpoint.peers import detect_peer, open_peer
from hybrid.checkpoint.peers.base import PeerCheckpoint
from hybrid.checkpoint.save import ExtraFile, whole_model_signature
from hybrid.checkpoint.single_rank import write_single_rank_checkpoint
from hybrid.errors import CheckpointError
from hybrid.parallel.agree import agree_error
from hybrid.parallel.state import ParallelState

log = logging.getLogger("hybrid")


def import_peer(peer: PeerCheckpoint, save_dir: str, config: dict,
                vocab_size: int | None, beat=None) -> str:
    """Write ``peer`` as hybrid checkpoint ``save_dir/iter_N`` (N: its iteration); return
    its directory. ``config``: the run's flat flags, recorded as the checkpoint's, with
    the ones the peer determines (``peer.flags``) over them; ``vocab_size``: the run's
    tokenizer's, when the peer does not record one. One process (rank 0 of a run). A
    peer whose format leaves part of the model's shape unrecorded (a DCP checkpoint's
    head count) takes it from ``config`` first (:meth:`PeerCheckpoint.configure`).
    ``beat()``: called as the import goes (:class:`ImportWait`)."""
    peer.configure(config)
    scaler = getattr(peer, "loss_scaler", None)  # (fp16's; its notes before they are logged)
    for line in peer.notes:
        log.warning("%s (%s): %s", peer.path, peer.format, line)
    os.makedirs(save_dir, exist_ok=True)
    origin = {"format": peer.format, "path": os.path.abspath(peer.path),
              "iteration": peer.iteration, "not_carried": list(peer.notes)}
    extra: dict = {"imported_from": origin}
    files: dict[str, ExtraFile] = {}
    untrained = peer.untrained()  # (frozen parameters and buffers: a module's, whole)
    if untrained:
        files[module_state.FILE] = module_state.writer(untrained)
        extra["module_state_file"] = module_state.FILE
    if peer.frozen_shapes:
        extra["frozen_parameters"] = list(peer.frozen_shapes)
        extra["module_state_excludes_frozen"] = peer.excludes_frozen
    out = write_single_rank_checkpoint(
        save_dir, dict(peer.shapes), peer.read, tuple(peer.columns), {**config, **peer.flags},
        peer.vocab_size if peer.vocab_size is not None else vocab_size,
        iteration=peer.iteration, consumed_samples=peer.consumed_samples, step=peer.step,
        extra=extra, beat=beat, frozen_shapes=peer.frozen_shapes, files=files,
        loss_scaler=scaler)
    log.info("imported %s checkpoint %s (iteration %d) as %s", peer.format, peer.path,
             peer.iteration, out)
    return out


class ImportWait:
    """The other ranks' wait while rank 0 imports, in short collectives over the world.

    [Note: waiting for an import of any size]
    Rank 0 alone reads the peer and writes the import: time O(model), minutes to an hour
    for a large model, longer than the collective timeout (``--distributed-timeout-
    minutes``) a plain barrier would wait under. So the wait is a series of one-element
    all-reduces (MAX) over the world: rank 0 joins one at least every ``every_s``
    seconds of its import (:meth:`beat`, called per parameter and per hashed block) with
    0, and a last one with 1 when it is done or failed (:meth:`done`); the other ranks
    loop on them until they see the 1 (:meth:`wait`). Each collective waits at most
    ``every_s``, a quarter of the timeout (a minute at most), so a long import never
    times out, while a rank 0 that stopped (a hung file system, a dead process) still
    ends the job at the timeout, named by the flight recorder like any stalled
    collective. The number of rounds follows rank 0's clock; every rank takes each one,
    so they stay paired."""

    def __init__(self, ps: ParallelState):
        self.ps = ps
        self.every_s = min(60.0, ps.timeout.total_seconds() / 4)
        self.last = time.monotonic()
        self.rounds = 0

    def _round(self, flag: int) -> bool:
        t = torch.tensor([flag], dtype=torch.int64, device=self.ps.device)
        self.ps.world_group.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        self.rounds += 1
        self.last = time.monotonic()
        return bool(t.item())

    def beat(self) -> None:
        """Rank 0, importing: a round when ``every_s`` has passed since the last."""
        if self.ps.world_size > 1 and time.monotonic() - self.last >= self.every_s:
            self._round(0)

    def done(self) -> None:
        """Rank 0: the import is over (written, reused or failed)."""
        if self.ps.world_size > 1:
            self._round(1)

    def wait(self) -> None:
        """The other ranks: until rank 0 is done."""
        while not self._round(0):
            pass


def import_for_load(load_dir: str, save_dir: str | None, ps: ParallelState, config: dict,
                    vocab_size: int | None, fmt: str | None = None, step: int | None = None,
                    owner: dict | None = None, opener=None,
                    model: torch.nn.Module | None = None, newest_on_reuse: bool = True
                    ) -> tuple[str, int | None] | None:
    """Collective over the world: when ``load_dir`` holds a peer's checkpoint (format
    ``fmt``, or detected), rank 0 imports its newest iteration (or ``step``) into
    ``save_dir`` (:func:`import_peer`; recording ``owner``, the run's claim, as the
    directory's owner) and every rank gets ``(save_dir, its iteration)`` to load; None
    when ``load_dir`` holds no peer checkpoint (hybrid's own, or nothing). Errors (no
    ``save_dir``, an unreadable peer checkpoint) are raised on every rank with rank 0's
    message. When ``save_dir`` already holds ``iter_N`` imported from the same checkpoint
    (a restart of the same command), nothing is read of the peer and, with
    ``newest_on_reuse``, the iteration returned is None: load ``save_dir``'s newest
    checkpoint, which may be a later save of this run (False: the import's iteration,
    for a directory holding imports only, one per tag). ``opener(load_dir, fmt, step)``: opens
    the peer instead of :func:`open_peer` (``engine.load_checkpoint`` keeps the module's
    own names). ``model``: the run's model (one pipeline stage of it), which the peer's
    names and shapes are checked against before anything is written (the message names
    the peer's checkpoint)."""
    if fmt == "hybrid" and not complete_checkpoints(load_dir) and os.path.isdir(load_dir):
        forced = detect_peer(load_dir)  # (every rank sees the same files: raised on each)
        if forced is not None:
            raise CheckpointError(f"--load-format hybrid: --load {load_dir} holds a {forced} "
                                  f"checkpoint, not a hybrid one: give --load-format "
                                  f"{forced} or auto to import it")
    if fmt == "hybrid" or (fmt is None and complete_checkpoints(load_dir)):
        return None  # hybrid's own checkpoints win over anything else in the directory
    found = fmt if fmt is not None else detect_peer(load_dir)
    if found is None:
        return None
    # the whole model's names and shapes (gathered over the pipeline: every rank is here)
    signature = whole_model_signature(model, ps) if model is not None else None
    error, iteration = None, -1  # (-2: imported before, load save_dir's newest)
    waiting = ImportWait(ps)
    if ps.rank != 0:
        waiting.wait()
    else:
        try:
            if save_dir and os.path.realpath(save_dir) == os.path.realpath(load_dir):
                raise CheckpointError(
                    f"--load {load_dir} holds a {found} checkpoint and is also --save: hybrid "
                    f"imports it into --save as a checkpoint of its own, whose names would "
                    f"mix with the {found} ones; give --save a new directory")
            if not save_dir:
                raise CheckpointError(
                    f"--load {load_dir} holds a {found} checkpoint: hybrid imports it into "
                    f"--save as a checkpoint of its own (its iteration, weights and "
                    f"optimizer state), then loads that; give --save")
            peer = (opener or open_peer)(load_dir, found, step)
            try:
                iteration = peer.iteration
                done = os.path.join(save_dir, iter_name(iteration))
                if os.path.isfile(os.path.join(done, "metadata.json")):
                    origin = read_metadata(done).get("imported_from") or {}
                    if origin.get("path") != os.path.abspath(peer.path):
                        raise CheckpointError(
                            f"--save {save_dir} already holds {iter_name(iteration)}, not "
                            f"imported from {peer.path}: give --save a new directory")
                    log.info("%s: imported from %s before; loading %s", done, peer.path,
                             f"{save_dir}'s newest checkpoint" if newest_on_reuse else done)
                    iteration = -2 if newest_on_reuse else iteration
                else:
                    peer.configure(config)  # (what it does not record, from the run's flags)
                    if model is not None:  # another model: refused before anything is written
                        check_model({"model": peer.shapes, "config": {**config, **peer.flags},
                                     "vocab_size": peer.vocab_size,
                                     "imported_from": {"format": peer.format}}, model, vocab_size,
                                    f"{peer.path} ({peer.format})", signature)
                    import_peer(peer, save_dir, config, vocab_size, waiting.beat)
                    if owner is not None:
                        write_owner(save_dir, owner)
                    # (a later run of the same --load and --save resumes this one's saves)
                    with open(os.path.join(save_dir, IMPORTED), "w", encoding="utf-8") as f:
                        json.dump({"load": os.path.realpath(load_dir)}, f)
            finally:
                peer.close()
        except CheckpointError as e:
            error = str(e)
        except OSError as e:  # (a full disk's write names no file: name --save)
            error = (f"--save {save_dir}: the import of {load_dir} failed "
                     f"({f'{e.filename}: ' if e.filename else ''}{e.strerror or e}); nothing "
                     f"of it was published there")
        finally:
            waiting.done()
    error = agree_error(ps, error)
    if error:
        raise CheckpointError(error)
    t = torch.tensor([iteration], dtype=torch.long, device=ps.device)
    ps.world_group.broadcast(t, src=0)
    assert save_dir is not None  # (rank 0 raised otherwise, and every rank with it)
    return save_dir, (None if int(t.item()) == -2 else int(t.item()))
