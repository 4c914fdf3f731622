"""The fused CUDA kernels of ``csrc/cuda`` as one extension, ``hybrid_cuda_ops``.

    ops = cuda_ops()   # the module, or None (no GPU, no nvcc, --no-kernels)

Functions (all tensors contiguous CUDA; T is fp32, bf16 or fp16):
    layer_norm_fwd(x (..., C) T, w (C,) T, b (C,) T, eps) -> [y T, mean fp32 (R,), rstd fp32 (R,)]
    layer_norm_bwd(dy, x, w, mean, rstd) -> [dx T, dw T, db T]
    bias_gelu_fwd(x (..., C) T, bias (C,) T, tanh: bool) -> y T
    bias_gelu_bwd(dy, x, bias, tanh: bool) -> [dx T, dbias T]
    ce_stats(logits (N, V) T, target int64 (N,), vocab_start, valid)
        -> [max, sumexp, tlogit] fp32 (N,)
    ce_grad(logits, target, M, S, grad_loss (fp32 (N,) each), vocab_start, valid) -> grad (N, V) T
    adam_step(master, grad, exp_avg, exp_avg_sq, out, seg_bounds, seg_decay, lr, beta1, beta2,
              eps, weight_decay, step, grad_scale, found_inf) -> None   (see hybrid/kernels/adam.py)

R is the number of rows (x.numel() / C). Callers should use the wrappers in
``hybrid.kernels`` (which pick the kernel or the PyTorch fallback), not this.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib

from hybrid.kernels.build import CSRC, load_extension

SOURCES = ["cuda/ops.cpp", "cuda/common.cu", "cuda/layer_norm.cu", "cuda/layer_norm_multipass.cu",
           "cuda/bias_gelu.cu", "cuda/cross_entropy.cu", "cuda/fused_adam.cu"]
HEADERS = ["cuda/ops.h", "cuda/common.cuh", "cuda/layer_norm.cuh"]


@functools.cache
def _headers_digest() -> str:
    """load_extension keys its cache on sources and flags only: a define carrying
    the headers' hash makes a header edit rebuild too (taken once per process)."""
    h = hashlib.sha256()
    for name in HEADERS:
        with contextlib.suppress(OSError):
            h.update((CSRC / name).read_bytes())
    return h.hexdigest()[:16]


def cuda_ops():
    """The loaded ``hybrid_cuda_ops`` module, or None (never raises).

    Called on every fused op, so after the first call it is a dict lookup
    (load_extension remembers the module; the header hash is taken once).
    """
    digest = f"-DHYBRID_HEADERS_{_headers_digest()}"
    # -O3 everywhere; no --use_fast_math: the kernels must agree with the fallbacks.
    # The architecture comes from TORCH_CUDA_ARCH_LIST or the visible GPU (sm_90 on H100).
    return load_extension("hybrid_cuda_ops", SOURCES, cuda=True, cflags=["-O3", digest],
                          cuda_cflags=["-O3", "--expt-relaxed-constexpr", digest])
