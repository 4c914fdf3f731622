"""The host tiers' compiled code as one extension, ``hybrid_cpu_ops``.

    ops = cpu_ops()   # the module, or None (no compiler, --no-kernels)

``csrc/cpu_adam.cpp``: ``adam_step`` (ZeRO-Offload's fused AdamW on a host
shard, see :mod:`hybrid.kernels.adam`), ``triad``, ``build_info``.
``csrc/aio.cpp``: ``Pool``, the swap I/O threads (see :mod:`hybrid.kernels.aio`).

One build for both: the optimizer offload needs the first and its nvme tier
the second, and compiling them together (in parallel, one link) costs one
extension's build time rather than two.
"""

from __future__ import annotations

from hybrid.kernels.build import load_extension


def cpu_ops():
    """The compiled module (built on first use, cached) or None."""
    # -ffp-contract=off: the Adam step is piece-exact only without contraction
    # (hybrid/kernels/adam.py, "Every element ...")
    return load_extension("hybrid_cpu_ops", ["cpu_adam.cpp", "aio.cpp"],
                          cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                          ldflags=["-fopenmp"])
