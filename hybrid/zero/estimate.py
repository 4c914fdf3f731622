"""Model-state memory per rank from the ZeRO paper's formulas, before buying a cluster.

With Psi parameters on a TP rank, N data-parallel ranks, p and g bytes per
parameter and gradient element, and K bytes of optimizer state per parameter:

    stage 0:  p Psi      + g Psi      + K Psi
    stage 1:  p Psi      + g Psi      + K Psi / N
    stage 2:  p Psi      + g Psi / N  + K Psi / N
    stage 3:  p Psi / N  + g Psi / N  + K Psi / N

Mixed precision (bf16/fp16) with Adam: p = g = 2 and K = 12 (fp32 master
weights, momentum and variance). fp32: p = g = 4 and K = 8 (the parameters are
their own master copy). This is what :meth:`ZeroEngine.model_state_bytes`
measures, padding aside.
"""

from __future__ import annotations

BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}


def model_state_bytes(psi: int, dp: int, stage: int, dtype: str = "bf16") -> dict:
    """Per-rank bytes of params, grads, optimizer states and their total."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0-3, got {stage}")
    p, g, k = BYTES[dtype]
    params = p * psi / (dp if stage >= 3 else 1)
    grads = g * psi / (dp if stage >= 2 else 1)
    optim = k * psi / (dp if stage >= 1 else 1)
    return {"params": int(params), "grads": int(grads), "optimizer": int(optim),
            "total": int(params + grads + optim)}
