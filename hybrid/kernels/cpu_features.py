"""Whether this CPU multiplies bf16 / fp16 matrices natively.

PyTorch's CPU matmul in bf16 goes to oneDNN, which is fast only with the
AVX512-BF16 or AMX-BF16 instructions (fp16: AVX512-FP16 or AMX-FP16). Without
them it runs an emulation or PyTorch's reference GEMM, whose non-transposed
layout -- the input gradient ``dy @ W`` of every linear layer -- took 48x
fp32's time in bf16 (512 x 768 @ 768 x 3072, oneDNN limited to AVX2) and 200x
in fp16 (this AVX512-BF16 CPU has no AVX512-FP16), and the head's
``(B T, V) @ (V, C)`` 456x: a whole step 45x (``benchmarks/bench_bf16_cpu.py``).
The answer comes from the instruction-set flags the kernel reports
(``/proc/cpuinfo``: ``flags`` on x86, ``Features`` on Arm), read once; a CPU
whose flags cannot be read counts as not native.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# Any one of these flags means a native matmul for the dtype.
NATIVE_FLAGS = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16", "bf16"}),  # "bf16": Arm BF16
    torch.float16: frozenset({"avx512_fp16", "amx_fp16", "fphp", "asimdhp"}),
}

# Measured with benchmarks/bench_bf16_cpu.py (12 layers x 768, sequence 256,
# micro-batch 2, vocabulary 50257, ZeRO-0, one thread) on a CPU without native
# bf16 matmuls (an AVX512-BF16 CPU limited to AVX2 through ONEDNN_MAX_CPU_ISA,
# MKL_ENABLE_INSTRUCTIONS and ATEN_CPU_CAPABILITY): step time over fp32's.
SLOWDOWN_TORCH_MATMUL = 45  # torch's bf16 matmuls: 260.8 s against 5.74 s
SLOWDOWN_ROUTED = 1.01  # the same matmuls in fp32 (hybrid.kernels.linear): 6.10 s / 6.02 s


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags, lower case (empty when unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.lower().split())
    return frozenset()


def native_cpu_matmul(dtype: torch.dtype) -> bool:
    """True when this CPU multiplies ``dtype`` matrices natively (fp32 always)."""
    flags = NATIVE_FLAGS.get(dtype)
    return flags is None or bool(flags & cpu_flags())
