"""Which implementation of each fusable op runs on CUDA.

Paths: ``"fused"`` (the csrc/cuda kernel), ``"eager"`` (plain PyTorch ops, the
exact reference) and ``"compile"`` (the eager function under ``torch.compile``).
CPU tensors, autocast regions and ``HYBRID_NO_KERNELS=1`` always get eager.
``CUDA_CHOICE`` holds the fastest path measured by ``scripts/bench_kernels.py``
(``--write-choice`` prints the table); ``HYBRID_KERNEL_CHOICE`` overrides it per
op for tests and benchmarks, e.g. ``layer_norm=fused,bias_gelu=compile``.
A "fused" choice whose extension did not build falls back to eager.
"""

from __future__ import annotations

import os

import torch

from hybrid.kernels.build import kernels_disabled

OPS = ("layer_norm", "bias_gelu", "cross_entropy", "adam")
PATHS = ("fused", "eager", "compile")

# Measured by scripts/bench_kernels.py on an H100 80GB HBM3 (torch 2.11, CUDA 13),
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

_env_cache: tuple[str, dict[str, str]] | None = None


def _env_overrides() -> dict[str, str]:
    global _env_cache
    raw = os.environ.get("HYBRID_KERNEL_CHOICE", "")
    if _env_cache is not None and _env_cache[0] == raw:
        return _env_cache[1]
    out = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        op, _, path = item.partition("=")
        op, path = op.strip(), path.strip()
        if op not in OPS and op != "all" or path not in PATHS:
            raise ValueError(f"HYBRID_KERNEL_CHOICE: bad entry {item!r}; expected op=path with "
                             f"op in {OPS + ('all',)} and path in {PATHS}")
        if op == "all":
            out.update(dict.fromkeys(OPS, path))
        else:
            out[op] = path
    _env_cache = (raw, out)
    return out


def kernel_choice(op: str, device: torch.device) -> str:
    """The path ``op`` takes for tensors on ``device``: fused, eager or compile."""
    if device.type != "cuda" or kernels_disabled() or torch.is_autocast_enabled("cuda"):
        return "eager"
    path = _env_overrides().get(op, CUDA_CHOICE[op])
    if path == "fused":
        from hybrid.kernels.cuda_ops import cuda_ops
        if cuda_ops() is None:
            return "eager"
    return path


_compiled: dict[object, object] = {}


def compiled(fn):
    """``torch.compile(fn)``, built once per function."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=None)
    return _compiled[fn]
