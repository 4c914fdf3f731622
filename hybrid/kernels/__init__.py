"""Fused kernels from ``csrc/`` with their exact PyTorch fallbacks.

Callers ask this package for an op and never learn which implementation
answered: a compiled kernel when it built and is the faster path, else the
PyTorch code that computes the same numbers. ``configure(KernelConfig(...))``,
called once at start-up by the entry point, sets what may load and which path
each op takes (``--no-kernels`` forces every fallback).

* :mod:`.settings`      the kernel settings of this process, set once at start-up from the config
* :mod:`.select`        which implementation of each fusable op runs
* :mod:`.build`         build and load the C++/CUDA extensions in ``csrc/``, or say why not;
                        one builder per cache directory, saying when it starts and ends
* :mod:`.__main__`      ``python -m hybrid.kernels``: build the kernels ahead of the first run
* :mod:`.cuda_ops`      the fused CUDA kernels of ``csrc/cuda`` as one extension
* :mod:`.cpu_ops`       the host tiers' compiled code as one extension, ``hybrid_cpu_ops``
* :mod:`.cpu_features`  whether this CPU multiplies bf16 / fp16 matrices natively
* :mod:`.dtypes`        the one map from a precision's name (``--bf16``, ``--fp16``) to its dtype
* :mod:`.linear`        ``y = x W^T + b`` for the TP layers: torch's own, or in fp32 on a CPU
                        without native bf16/fp16 matrix multiplies
* :mod:`.layer_norm`    LayerNorm over the last dimension: fused CUDA kernel, eager, or compile
* :mod:`.rms_norm`      RMSNorm over the last dimension, as Llama uses it
* :mod:`.bias_gelu`     ``gelu(x + bias)`` for the GPT MLP: fused CUDA kernel, eager, or compile
* :mod:`.swiglu`        SwiGLU, the gated MLP activation of Llama
* :mod:`.grouped_linear` the MoE experts' matrix multiplies: each group of rows times its own
                        weight
* :mod:`.rotary`        a fused, grouped QKV split into query, key and value heads, with rotary
                        embeddings
* :mod:`.attention`     Megatron's ``--attention-backend`` names mapped onto torch's SDPA kernels
* :mod:`.cross_entropy` per-rank pieces of the vocab-parallel cross-entropy, kernel or PyTorch
* :mod:`.adam`          AdamW steps, and the one place that decides what runs them
* :mod:`.aio`           asynchronous reads and writes between CPU tensors and files: NVMe
                        offload's swap I/O
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
