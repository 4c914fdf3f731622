"""Whether this CPU multiplies bf16 / fp16 matrices natively, and what to say when not.

PyTorch's CPU matmul in bf16 goes to oneDNN, which is fast only with the
AVX512-BF16 or AMX-BF16 instructions (fp16: AVX512-FP16 or AMX-FP16). Without
them it runs an emulation or PyTorch's reference GEMM, whose non-transposed
layout -- the input gradient ``dy @ W`` of every linear layer -- took 48x
fp32's time in bf16 (512 x 768 @ 768 x 3072, oneDNN limited to AVX2) and 200x
in fp16 (this AVX512-BF16 CPU has no AVX512-FP16), and the head's
``(B T, V) @ (V, C)`` 456x: a whole step 45x (``scripts/bench_bf16_cpu.py``).
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
_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Measured with scripts/bench_bf16_cpu.py (12 layers x 768, sequence 256,
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


def low_precision_warning(params_dtype: str, device: torch.device) -> str | None:
    """The start-up warning for training in ``params_dtype`` ("bf16", "fp16", "fp32")
    on ``device``, or None when there is nothing to say."""
    dtype = _NAMES.get(params_dtype)
    if dtype is None or device.type != "cpu" or native_cpu_matmul(dtype):
        return None
    from hybrid.kernels.select import kernel_choice
    want = " or ".join(sorted(f for f in NATIVE_FLAGS[dtype] if "_" in f))
    head = (f"--{params_dtype} on a CPU without native {params_dtype} matrix multiplies "
            f"(no {want} in its flags): ")
    advice = f"Train in fp32 (drop --{params_dtype}) unless memory is what you are short of."
    if kernel_choice("linear", device, dtype) == "fp32":
        return (head + f"PyTorch's {params_dtype} matmuls made a step {SLOWDOWN_TORCH_MATMUL}x "
                f"an fp32 one on such a CPU (a 12 x 768 GPT, measured), so hybrid computes them in fp32 (--kernel-choice "
                f"linear=fp32), and a step costs about what an fp32 step does "
                f"({SLOWDOWN_ROUTED}x): {params_dtype} saves memory here, not time. "
                + advice)
    return (head + f"with --kernel-choice linear=eager its {params_dtype} matmuls make a step "
            f"about {SLOWDOWN_TORCH_MATMUL}x an fp32 one. " + advice)
