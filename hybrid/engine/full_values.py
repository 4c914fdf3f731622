"""A parameter's full fp32 values from the engine's shards: master, optimizer state, gradient.

What DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` and its kin return, over
hybrid's engine: each rank of the parameter's ZeRO group writes the pieces of the
parameter it owns (:meth:`hybrid.zero.ZeroEngine.owned_pieces`) into zeros, and one sum
over the group makes the whole (each element is owned by one rank, so the sum adds
zeros only and is exact). Where the optimizer is not sharded (stage 0) every rank owns
every piece and reads it alone. Collective under sharding: every rank of the group
calls it, for the same parameter. Values are TP-local (a TP layer's shard of the
weight), fp32, on the engine's device, shaped as the parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybrid.errors import ConfigError

if TYPE_CHECKING:
    from hybrid.engine.api import Engine


def engine_of(param: torch.Tensor, where: str) -> Engine:
    """The engine ``param`` is trained by (``initialize`` marks its parameters)."""
    engine = getattr(param, "hybrid_engine", None)
    if engine is None:
        raise ConfigError(f"{where}(param): the tensor is not a parameter of a model passed "
                          f"to initialize(); pass one of engine.module's parameters")
    return engine


@torch.no_grad()
def full_value(engine: Engine, param: torch.Tensor, key: str) -> torch.Tensor | None:
    """The whole of ``param``'s ``key`` (``master``, or a per-element optimizer state such
    as ``exp_avg``; ``grad``: the reduced gradient the next step reads, unscaled), or None
    for a frozen parameter (it has no master nor gradient). Collective (module doc)."""
    zero = engine.zero
    if not param.requires_grad:
        return None
    if key not in ("grad", *zero.optimizer.columns):
        raise ConfigError(f"safe_get_full_optimizer_state(param, {key!r}): the optimizer "
                          f"keeps {', '.join(c for c in zero.optimizer.columns if c != 'master')}"
                          f" per element")
    zero.wait_optimizer()  # (a delayed host update still running would change the master)
    flat = torch.zeros(param.numel(), dtype=torch.float32, device=engine.device)
    # the gradient is a multiple of the loss scale until the step divides it out
    scale = zero.scaler.scale if key == "grad" else 1.0
    for pc in zero.owned_pieces():
        if pc.param is param:
            values = (zero.grad_values(pc) if key == "grad"
                      else zero.optimizer.read_piece(key, pc.unit, pc.part))
            flat[pc.lo: pc.hi] = values.to(flat.device, torch.float32) / scale
    if zero.plan.optimizer:  # each element on one rank of the group: the others add zeros
        engine.ps.dp_cp_group.all_reduce(flat)
    return flat.view(param.shape)
