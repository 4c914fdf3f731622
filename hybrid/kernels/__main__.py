"""``python -m hybrid.kernels``: build the kernels now, ahead of the first run that needs them.

The CPU kernels (``hybrid_cpu_ops``: the host tiers' Adam step and swap I/O) always, and
the CUDA kernels where a GPU is, into the cache the environment names
(``HYBRID_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/hybrid/kernels``, else
``~/.cache/hybrid/kernels``): the first offload run then loads them instead of compiling
for minutes. Exits 1 when one could not be built, after the line that says why.
"""

from __future__ import annotations

import logging
import os

import torch

from hybrid.config.kernels import kernel_config_from_env
from hybrid.kernels import settings
from hybrid.kernels.build import cache_root
from hybrid.kernels.cpu_ops import cpu_ops
from hybrid.kernels.cuda_ops import cuda_ops


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings.configure(kernel_config_from_env(os.environ))
    built = {"hybrid_cpu_ops": cpu_ops() is not None}
    if torch.cuda.is_available():
        built["hybrid_cuda_ops"] = cuda_ops() is not None
    for name, ok in built.items():
        print(f"{name}: {'ready' if ok else 'not built (the line above says why)'} "
              f"in {cache_root()}")
    return 0 if all(built.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
