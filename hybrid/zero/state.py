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


@torch.no_grad()
def shard_state(engine: ZeroEngine) -> dict:
    """This rank's pieces: ``{name: {"ranges", "master", "exp_avg", "exp_avg_sq"}}``.

    Values are fp32 CPU tensors, the pieces of one parameter concatenated in
    ``ranges`` order. Also the optimizer step count and loss-scaler state.
    """
    opt = engine.optimizer
    out: dict[str, dict] = {}
    for name, p, plo, ui, off, n in _pieces(engine):
        entry = out.setdefault(name, {"ranges": [], "master": [], "exp_avg": [],
                                      "exp_avg_sq": []})
        entry["ranges"].append((plo, plo + n))
        for key, src in (("master", opt.master), ("exp_avg", opt.exp_avg),
                         ("exp_avg_sq", opt.exp_avg_sq)):
            entry[key].append(src[ui][off: off + n].float().cpu().clone())
    for entry in out.values():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            entry[key] = torch.cat(entry[key])
    return {"params": out, "step": opt.step_count, "loss_scaler": engine.scaler.state_dict()}


@torch.no_grad()
def load_shard_state(engine: ZeroEngine, fetch, step: int, loss_scaler: dict | None) -> None:
    """Fill this rank's pieces from ``fetch(name, key, lo, hi) -> fp32 (hi - lo,)`` and
    republish the parameters (copy into the model dtype, all-gather where needed).

    ``key`` is "master", "exp_avg" or "exp_avg_sq"; ``[lo, hi)`` indexes the
    TP-local parameter flattened.
    """
    opt = engine.optimizer
    for name, p, plo, ui, off, n in _pieces(engine):
        for key, dst in (("master", opt.master), ("exp_avg", opt.exp_avg),
                         ("exp_avg_sq", opt.exp_avg_sq)):
            dst[ui][off: off + n].copy_(fetch(name, key, plo, plo + n))
    opt.step_count = step
    if loss_scaler is not None:
        engine.scaler.load_state_dict(loss_scaler)
    engine.publish_params()
