"""Fused kernels from ``csrc/`` with their exact PyTorch fallbacks.

Callers ask this package for an op and never learn which implementation
answered: a compiled kernel when it built and is the faster path, else the
PyTorch code that computes the same numbers. ``configure(KernelConfig(...))``,
called once at start-up by the entry point, sets what may load and which path
each op takes (``--no-kernels`` forces every fallback).
"""

from hybrid.kernels.bias_gelu import bias_gelu, splits_bias
from hybrid.kernels.build import kernels_disabled, load_extension
from hybrid.kernels.cross_entropy import local_softmax_stats, softmax_grad
from hybrid.kernels.cuda_ops import cuda_ops
from hybrid.kernels.layer_norm import LayerNorm, layer_norm
from hybrid.kernels.linear import linear, matmul
from hybrid.kernels.select import kernel_choice
from hybrid.kernels.settings import configure, current

__all__ = ["LayerNorm", "bias_gelu", "configure", "cuda_ops", "current", "kernel_choice",
           "kernels_disabled", "layer_norm", "linear", "load_extension", "local_softmax_stats",
           "matmul", "softmax_grad", "splits_bias"]
