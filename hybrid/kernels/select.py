"""Which implementation of each fusable op runs.

On CUDA: ``"fused"`` (the csrc/cuda kernel), ``"eager"`` (plain PyTorch ops, the
exact reference) and ``"compile"`` (the eager function under ``torch.compile``).
CPU tensors, autocast regions and ``KernelConfig.no_kernels`` get eager.
``CUDA_CHOICE`` holds the fastest path measured by ``benchmarks/bench_kernels.py``
(``--write-choice`` prints the table); ``KernelConfig.choice`` (``--kernel-choice``,
e.g. ``layer_norm=fused,bias_gelu=compile``) overrides it per op.
A "fused" choice whose extension did not build falls back to eager.

``linear`` is the other way round: CUDA always runs torch's own matmul; a CPU
runs bf16/fp16 products in fp32 (``"fp32"``, :mod:`hybrid.kernels.linear`) when
it has no native matmul for that dtype (:mod:`hybrid.kernels.cpu_features`),
``"eager"`` otherwise; ``--kernel-choice linear=eager|fp32`` forces either.
"""

from __future__ import annotations

import torch

from hybrid.config.sections import KERNEL_PATHS
from hybrid.kernels import settings
from hybrid.kernels.cpu_features import (
    NATIVE_FLAGS,
    SLOWDOWN_ROUTED,
    SLOWDOWN_TORCH_MATMUL,
    native_cpu_matmul,
)
from hybrid.kernels.dtypes import DTYPES

OPS = tuple(op for op in KERNEL_PATHS if op != "linear")  # the CUDA kernels

# Measured by benchmarks/bench_kernels.py on an H100 80GB HBM3 (torch 2.11, CUDA 13),
# GPT-1.3B shapes, bf16, forward+backward, median GPU ms per call, 10 calls back
# to back (2026-11-22):
#   layer_norm     eager 0.227  compile 0.537  fused 0.229   -> eager (fused forward
#                  alone is 1.26x eager, but forward+backward ties)
#   bias_gelu      eager 0.600  compile 0.586  fused 0.410   -> fused (1.47x)
#   cross_entropy  eager 12.05  compile 2.192  fused 1.022   -> fused (V=50304; torch's
#                  F.cross_entropy in fp32, what TP=1 runs otherwise: 7.84)
#   adam (100M)    torch _fused_adamw_ + bf16 copy 1.261, fused 1.001 -> fused (1.26x)
# A non-eager path is chosen only when it beats eager by 5% or more.
CUDA_CHOICE = {"layer_norm": "eager", "bias_gelu": "fused", "cross_entropy": "fused",
               "adam": "fused"}


def kernel_choice(op: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The path ``op`` takes for tensors of ``dtype`` on ``device`` (see the module doc)."""
    cfg = settings.current()
    if op == "linear":
        return _linear_choice(device, dtype, cfg.path_for("linear"))
    if device.type != "cuda" or cfg.no_kernels or torch.is_autocast_enabled("cuda"):
        return "eager"
    path = cfg.path_for(op) or CUDA_CHOICE[op]
    if path == "fused":
        from hybrid.kernels.cuda_ops import cuda_ops
        if cuda_ops() is None:
            return "eager"
    return path


def _linear_choice(device: torch.device, dtype: torch.dtype | None, told: str | None) -> str:
    if (device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16)
            or torch.is_autocast_enabled("cpu")):  # autocast would cast the fp32 copies back
        return "eager"
    if told is not None:
        return told
    return "eager" if native_cpu_matmul(dtype) else "fp32"


def low_precision_warning(params_dtype: str, device: torch.device) -> str | None:
    """The start-up warning for training in ``params_dtype`` ("bf16", "fp16", "fp32")
    on ``device``, or None when there is nothing to say."""
    dtype = DTYPES[params_dtype]
    if dtype == torch.float32 or device.type != "cpu" or native_cpu_matmul(dtype):
        return None
    want = " or ".join(sorted(f for f in NATIVE_FLAGS[dtype] if "_" in f))
    head = (f"--{params_dtype} on a CPU without native {params_dtype} matrix multiplies "
            f"(no {want} in its flags): ")
    advice = f"Train in fp32 (drop --{params_dtype}) unless memory is what you are short of."
    if kernel_choice("linear", device, dtype) == "fp32":
        return (head + f"PyTorch's {params_dtype} matmuls made a step {SLOWDOWN_TORCH_MATMUL}x "
                f"an fp32 one on such a CPU (a 12 x 768 GPT, measured), so hybrid computes "
                f"them in fp32 (--kernel-choice linear=fp32), and a step costs about what an "
                f"fp32 step does ({SLOWDOWN_ROUTED}x): {params_dtype} saves memory here, not time. "
                + advice)
    return (head + f"with --kernel-choice linear=eager its {params_dtype} matmuls make a step "
            f"about {SLOWDOWN_TORCH_MATMUL}x an fp32 one. " + advice)


_compiled: dict[object, object] = {}


def compiled(fn):
    """``torch.compile(fn)``, built once per function."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=None)
    return _compiled[fn]
