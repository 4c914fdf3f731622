"""What a ZeRO engine has to save, and how it takes it back, in layout-free terms.

A rank's training state is, for every parameter it owns a piece of, the fp32
master values and both Adam moments of that piece. A piece is described by
the parameter's name and an element range of the *TP-local* parameter
flattened (``[lo, hi)``), so it means the same thing whatever the ZeRO stage,
bucket size or DP size that wrote it. Turning TP-local ranges into full
tensors (and back, for another TP size) is the checkpoint module's job.
"""

from __future__ import annotations

import torch

from hybrid.zero.engine import ZeroEngine


def _pieces(engine: ZeroEngine):
    """(param name, param, local lo, unit index, offset in the unit's owned part, length)."""
    names = {id(p): n for n, p in engine.model.named_parameters()}
    for ui, u in enumerate(engine.units):
        for i, plo, ulo, n in u.segments(u.own_lo, u.own_hi):
            p = u.params[i]
            yield names[id(p)], p, plo, ui, ulo - u.own_lo, n


def shard_state(engine: ZeroEngine) -> dict:
    """This rank's pieces ``[(name, lo, hi)]`` in owned order (unit by unit, in unit
    coordinates), the optimizer step count and the loss-scaler state.

    The values come from :func:`iter_piece_values`, one piece at a time.
    """
    pieces = [(name, plo, plo + n) for name, _, plo, _, _, n in _pieces(engine)]
    return {"pieces": pieces, "step": engine.optimizer.step_count,
            "loss_scaler": engine.scaler.state_dict()}


@torch.no_grad()
def iter_piece_values(engine: ZeroEngine):
    """For each piece of :func:`shard_state`, in its order: an fp32 CPU ``(n, 3)``
    tensor of rows ``[master, exp_avg, exp_avg_sq]``."""
    opt = engine.optimizer
    for _, _, _, ui, off, n in _pieces(engine):
        yield torch.stack([src[ui][off: off + n] for src in
                           (opt.master, opt.exp_avg, opt.exp_avg_sq)], dim=1).float().cpu()


@torch.no_grad()
def load_shard_state(engine: ZeroEngine, fetch, step: int, loss_scaler: dict | None) -> None:
    """Fill this rank's pieces from ``fetch(name, lo, hi) -> fp32 (hi - lo, 3)`` (rows
    ``[master, exp_avg, exp_avg_sq]``) and republish the parameters (copy into the
    model dtype, all-gather where needed).

    ``[lo, hi)`` indexes the TP-local parameter flattened.
    """
    opt = engine.optimizer
    for name, p, plo, ui, off, n in _pieces(engine):
        rows = fetch(name, plo, plo + n)
        for k, dst in enumerate((opt.master, opt.exp_avg, opt.exp_avg_sq)):
            dst[ui][off: off + n].copy_(rows[:, k])
    opt.step_count = step
    if loss_scaler is not None:
        engine.scaler.load_state_dict(loss_scaler)
    engine.publish_params()
