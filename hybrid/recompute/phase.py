"""RecomputePhase: the public signal that a forward is a recompute inside backward.

Activation checkpointing runs a block's forward a second time during backward.
Whoever hooks that block's forward (ZeRO-3 gathers and frees parameters there)
must tell the two apart: the recompute's backward follows at once, so the
parameters must stay. Checkpointing sets the signal around each recompute;
ZeRO reads it. One object is shared by both, passed explicitly::

    phase = RecomputePhase()
    apply_activation_checkpointing(model, ps, rng, cfg.recompute, phase=phase)
    apply_zero(model, ps, cfg.zero, recompute=phase)
"""

from __future__ import annotations

import contextlib


class RecomputePhase:
    """``active`` is True while some checkpointed forward is being recomputed."""

    def __init__(self) -> None:
        self._depth = 0

    @property
    def active(self) -> bool:
        return self._depth > 0

    @contextlib.contextmanager
    def recomputing(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
