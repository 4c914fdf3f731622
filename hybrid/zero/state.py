"""What a ZeRO engine has to save, and how it takes it back, in layout-free terms.

A rank's training state is, for every parameter it owns a piece of, the fp32
master values and the optimizer's per-element state of that piece (both Adam
moments for hybrid's AdamW; a client optimizer's own: ``optimizer.columns``). A
piece is described by the parameter's name and an element range of the *TP-local* parameter
flattened (``[lo, hi)``), so it means the same thing whatever the ZeRO stage,
bucket size or DP size that wrote it. Turning TP-local ranges into full
tensors (and back, for another TP size) is the checkpoint module's job.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

import torch

from hybrid.errors import ConfigError
from hybrid.zero.engine import ZeroEngine
from hybrid.zero.optimizer import STATE_KEYS

KEYS = STATE_KEYS  # what a rank holds per element of its shard


def shard_state(engine: ZeroEngine) -> dict:
    """This rank's pieces ``[(name, lo, hi)]`` in owned order (unit by unit, in unit
    coordinates), the optimizer step count and the loss-scaler state.

    The values come from :func:`iter_piece_values`, one piece at a time.
    """
    engine.wait_optimizer()  # a delayed host update still running would change the values
    pieces = [(pc.name, pc.lo, pc.hi) for pc in engine.owned_pieces()]
    return {"pieces": pieces, "step": engine.optimizer.step_count,
            "loss_scaler": engine.scaler.state_dict()}


def check_saveable(engine: ZeroEngine) -> None:
    """ConfigError, before anything is written, when the optimizer keeps state a
    checkpoint cannot hold (resuming would silently lose it). The same on every rank."""
    unsaved = engine.optimizer.unsaved
    if unsaved:
        raise ConfigError(f"save_checkpoint: the optimizer keeps {', '.join(unsaved)} per "
                          f"parameter, which hybrid's checkpoints do not hold (they hold the "
                          f"per-element state and the step count); resuming would lose it, "
                          f"so nothing was saved: use an optimizer without it")


@torch.no_grad()
def iter_piece_values(engine: ZeroEngine, keys: Sequence[str] | None = None,
                      skip: Collection[str] = ()) -> Iterator[torch.Tensor]:
    """For each piece of :func:`shard_state`, in its order: an fp32 CPU ``(n, len(keys))``
    tensor of rows (default: every one of ``engine.optimizer.columns``). The pieces of
    the parameters named in ``skip`` are left out, unread."""
    keys = engine.optimizer.columns if keys is None else keys
    engine.wait_optimizer()
    opt = engine.optimizer  # (on the nvme tier each read streams from the swap file)
    for pc in engine.owned_pieces():
        if pc.name in skip:
            continue
        yield torch.stack([opt.read_piece(k, pc.unit, pc.part) for k in keys],
                          dim=1).float().cpu()


@torch.no_grad()
def load_shard_state(engine: ZeroEngine, fetch: Callable[[str, int, int], torch.Tensor],
                     keys: Sequence[str], step: int, loss_scaler: dict | None) -> None:
    """Fill this rank's pieces from ``fetch(name, lo, hi) -> fp32 (len(keys), hi - lo)``
    (one plane per name in ``keys``, ``master`` among them), set the optimizer's
    step count, and republish the parameters (copy into the model dtype, all-gather
    where needed). The optimizer's columns not in ``keys`` (its state, for a
    weights-only load) start afresh: zeros, or no state for a client optimizer.

    ``[lo, hi)`` indexes the TP-local parameter flattened.
    """
    if "master" not in keys:
        raise ValueError(f"load_shard_state needs the master values, got keys {keys}")
    engine.wait_optimizer()
    opt = engine.optimizer  # (on the nvme tier each write streams into the swap file)
    for pc in engine.owned_pieces():
        planes = fetch(pc.name, pc.lo, pc.hi)
        for key in opt.columns:
            opt.write_piece(key, pc.unit, pc.part,
                            planes[keys.index(key)] if key in keys else None)
    opt.step_count = step
    if loss_scaler is not None:
        engine.scaler.load_state_dict(loss_scaler)
    engine.publish_params()


@torch.no_grad()
def write_master_from_params(engine: ZeroEngine, params: Iterable[torch.Tensor]) -> None:
    """The full values of ``params`` (just changed in place, the same on every DP rank,
    inside :meth:`ZeroEngine.gathered`) become this rank's fp32 master pieces of them;
    then the parameters are republished. The Adam moments are kept. A frozen unit
    holding one of them keeps this rank's shard of its new values (it has no master:
    hybrid/zero/units.py, [Note: frozen units])."""
    engine.wait_optimizer()
    wanted = {id(p) for p in params}
    for u in engine.frozen_units:
        if u.gathered and any(id(p) in wanted for p in u.params):
            u.write_shard(u.full[u.own_lo: u.own_hi])  # (to its home, if offloaded)
    opt = engine.optimizer
    for pc in engine.owned_pieces():
        if id(pc.param) in wanted:
            values = pc.param.detach().reshape(-1)[pc.lo: pc.hi].float().cpu()
            opt.write_piece("master", pc.unit, pc.part, values)
    engine.publish_params()
