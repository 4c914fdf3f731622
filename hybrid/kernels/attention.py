"""Megatron's ``--attention-backend`` names mapped onto torch's SDPA kernels.

=========  ===================================  ==============================
name       torch SDPA backends allowed          Megatron's meaning
=========  ===================================  ==============================
auto       all (torch picks per call)           TE / mcore pick
flash      FLASH_ATTENTION                      FlashAttention
fused      CUDNN_ATTENTION, EFFICIENT_ATTENTION  cuDNN fused attention (TE)
unfused    MATH                                 softmax(QK^T)V in plain ops
local      MATH                                 Megatron's own unfused module
=========  ===================================  ==============================

Whether a backend can run depends on the device, dtype, head size and dropout,
and torch's rules for that change between versions, so
:func:`check_attention_backend` asks torch itself: one tiny attention call
with the run's settings before the model is built.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybrid.errors import ConfigError

BACKENDS: dict[str, list[SDPBackend] | None] = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "unfused": [SDPBackend.MATH],
    "local": [SDPBackend.MATH],
}


def attention_context(name: str):
    """A context in which ``F.scaled_dot_product_attention`` uses only ``name``'s kernels."""
    allowed = BACKENDS[name]
    return contextlib.nullcontext() if allowed is None else sdpa_kernel(allowed)


def check_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                            head_size: int, dropout: float) -> None:
    """Raise ConfigError naming ``--attention-backend`` if ``name`` cannot run causal
    attention here (device, dtype, head size, dropout) -- before any training."""
    if BACKENDS[name] is None:
        return
    q = torch.zeros(1, 1, 8, head_size, device=device, dtype=dtype, requires_grad=True)
    with warnings.catch_warnings(record=True) as said:  # torch warns why a kernel is out
        warnings.simplefilter("always")
        try:
            with attention_context(name):
                F.scaled_dot_product_attention(q, q, q, dropout_p=dropout,
                                               is_causal=True).sum().backward()
            return
        except RuntimeError as e:
            error = e
    why = [str(w.message).split(" (Triggered")[0] for w in said]
    reason = "; ".join(why) if why else str(error).strip().splitlines()[0]
    raise ConfigError(
        f"--attention-backend {name} cannot run on this {device.type} with "
        f"{str(dtype).removeprefix('torch.')} and head size {head_size}"
        f"{f' and dropout {dropout}' if dropout else ''} (torch: {reason}). Use "
        f"--attention-backend auto (torch picks a kernel that runs) or unfused")
