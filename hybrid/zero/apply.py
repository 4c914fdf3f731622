"""``apply_zero``: ZeRO-DP applied to a model from outside, the one call that builds a
:class:`~hybrid.zero.engine.ZeroEngine` (the engine's sections defaulting to their
dataclasses', stage 3's gather units defaulting to the model's blocks)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn

from hybrid.config.sections import (
    AdamWConfig,
    OffloadConfig,
    PrecisionConfig,
    ZeroConfig,
)
from hybrid.parallel.state import ParallelState
from hybrid.recompute.phase import RecomputePhase
from hybrid.zero.engine import ZeroEngine
from hybrid.zero.units import ValueSource


def apply_zero(model: nn.Module, ps: ParallelState, zero: ZeroConfig = ZeroConfig(), *,
               adamw: AdamWConfig = AdamWConfig(), precision: PrecisionConfig = PrecisionConfig(),
               offload: OffloadConfig = OffloadConfig(), values: ValueSource | None = None,
               unit_modules: Iterable[nn.Module] | None = None,
               parts: list[list[nn.Parameter]] | None = None,
               recompute: RecomputePhase | None = None,
               client: torch.optim.Optimizer | None = None, decay: str = "matrices",
               tied: Collection[str] = ()) -> ZeroEngine:
    """Wrap ``model`` for ZeRO stage ``zero.stage`` over ``ps.dp_cp_group`` ([Note: ZeRO ...]).

    The sections (each defaults to its dataclass defaults): ``zero`` how the
    states are sharded and communicated; ``adamw`` the optimizer and clipping;
    ``precision`` the training and gradient dtypes and the fp16 loss scale;
    ``offload`` what lives in host memory.

    ``values(name, param, lo, hi)``: fp32 values of a TP-local flat range of a
    parameter, for a model built on the meta device (e.g.
    ``InitValues(seed, model.init_of)``); default: the parameters' own (fp32)
    data. The engine keeps exact fp32 master weights and makes the parameters
    ``precision.params_dtype`` views of its buffers.
    ``unit_modules``: the modules whose parameters stage 3 gathers as one unit
    (default ``model.blocks`` when it exists).
    ``parts``: the model's parameters in disjoint lists that separate backwards reach
    (an interleaved pipeline rank's chunks: ``GPT.chunk_parameters()``); each backward
    then names its part (:meth:`ZeroEngine.begin_backward`, :mod:`hybrid.zero.parts`).
    ``recompute``: the :class:`RecomputePhase` activation checkpointing sets,
    so stage 3 keeps a recomputed block's parameters for its backward.
    ``client``: a ``torch.optim`` optimizer over the model's parameters to step the
    shard with instead of hybrid's AdamW (:mod:`hybrid.zero.client_optimizer`; its
    groups' hyperparameters apply, ``adamw`` gives only the clipping). ``decay``:
    which parameters hybrid's AdamW decays: "matrices" (Megatron's rule: no biases or
    norms) or "all" (DeepSpeed's: what it is given). ``tied``: names of parameters of
    which every rank of ``ps.embedding_group`` holds a copy (a tied word embedding under
    pipeline parallelism): their gradients are summed over that group at the step and
    the norm counts them on the first stage only ([Note: tied copies ...]); ignored where
    the group is this rank alone.
    """
    blocks = getattr(model, "blocks", None)  # (a transformer's, by convention)
    if unit_modules is None and blocks is not None:
        unit_modules = list(blocks)
    return ZeroEngine(model, ps, zero, adamw=adamw, precision=precision, offload=offload,
                      values=values, unit_modules=unit_modules, parts=parts,
                      recompute=recompute, client=client, decay=decay, tied=tied)
