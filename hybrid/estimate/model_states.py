"""Model-state memory and communication per rank, from the ZeRO paper's formulas.

With Psi parameters on a TP rank, N data-parallel ranks, p bytes per
parameter element, g bytes per gradient element and K bytes of optimizer state
per parameter:

    stage 0:  p Psi      + g Psi      + K Psi
    stage 1:  p Psi      + g Psi      + K Psi / N
    stage 2:  p Psi      + g Psi / N  + K Psi / N
    stage 3:  p Psi / N  + g Psi / N  + K Psi / N

Mixed precision (bf16/fp16) with Adam: p = 2 and K = 12 (fp32 master weights,
momentum and variance); g = 4 when gradients are accumulated and reduced in
fp32 (``--accumulate-allreduce-grads-in-fp32``, the default with bf16), else 2.
fp32: p = g = 4 and K = 8 (the parameters are their own master copy). This is
what :meth:`ZeroEngine.model_state_bytes` measures, padding aside.

Bytes each rank sends per optimizer step with k micro-batches, f = (N-1)/N
(ring algorithms; see :mod:`hybrid.parallel.comm`):

    stage 0:  all-reduce        2 g Psi f
    stage 1:  reduce-scatter      g Psi f        + all-gather    p Psi f
    stage 2:  reduce-scatter    k g Psi f        + all-gather    p Psi f
    stage 3:  reduce-scatter    k g Psi f        + all-gather 2 k p Psi f

Stages 0-1 accumulate micro-batches in a full gradient buffer and reduce it
once; stages 2-3 have no such buffer and reduce-scatter every micro-batch;
stage 3 also gathers every parameter before each micro-batch's forward and
again before its backward -- except under a pipeline step, which by default gathers
each unit once a step and holds it (``held``: all-gather ``p Psi f``, stage 2's;
``--pipeline-reshard-after-micro-batch`` gathers as above). So with gradient
accumulation, stage 2 trades
``g Psi (1 - 1/N)`` bytes of memory for ``(k - 1) g Psi f`` bytes of traffic
per step over stage 1: :func:`hybrid.estimate.memory.choose_stage` weighs
that against the peak memory of each stage.
"""

from __future__ import annotations

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _sizes(dtype: str, grads_dtype: str | None) -> tuple[int, int, int]:
    p = BYTES[dtype]
    g = BYTES[grads_dtype or dtype]
    k = 8 if dtype == "fp32" else 12
    return p, g, k


def _check(stage: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0-3, got {stage}")


def model_state_bytes(psi: int, dp: int, stage: int, dtype: str = "bf16",
                      grads_dtype: str | None = None) -> dict:
    """Per-rank bytes of params, grads, optimizer states and their total.

    ``grads_dtype``: what gradients are accumulated in (default ``dtype``).
    """
    _check(stage)
    p, g, k = _sizes(dtype, grads_dtype)
    params = p * psi / (dp if stage >= 3 else 1)
    grads = g * psi / (dp if stage >= 2 else 1)
    optim = k * psi / (dp if stage >= 1 else 1)
    return {"params": int(params), "grads": int(grads), "optimizer": int(optim),
            "total": int(params + grads + optim)}


def comm_bytes_per_step(psi: int, dp: int, stage: int, micro_batches: int = 1,
                        dtype: str = "bf16", grads_dtype: str | None = None,
                        held: bool = False) -> dict:
    """Bytes this rank sends per step, by collective kind (the table above).

    ``held``: stage 3 gathers each unit once a step and holds it (a pipeline step's
    default) instead of before every micro-batch's forward and backward.

    Excludes the few scalars of the grad-norm and overflow checks.
    """
    _check(stage)
    p, g, _ = _sizes(dtype, grads_dtype)
    f, k = (dp - 1) / dp, micro_batches
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    if stage == 0:
        out["all_reduce"] = 2 * g * psi * f
    else:
        out["reduce_scatter"] = (1 if stage == 1 else k) * g * psi * f
        out["all_gather"] = (2 * k if stage == 3 and not held else 1) * p * psi * f
    out = {kind: int(round(v)) for kind, v in out.items()}
    out["total"] = sum(out.values())
    return out

