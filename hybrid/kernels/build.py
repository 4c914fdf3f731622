"""Build and load the C++/CUDA extensions in ``csrc/``, or say why not.

    mod = load_extension("hybrid_cpu_adam", ["cpu_adam.cpp"])   # module or None

Each extension is compiled once with ``torch.utils.cpp_extension.load`` (ninja)
into a cache directory keyed by its sources, flags, torch version and CPU, so
later processes -- and every rank of a job -- import the cached library.
cpp_extension holds a file lock on that directory while it builds, so ranks
that start together wait for one compiler rather than racing.

Nothing here is required: when a kernel cannot build or load (no compiler, no
GPU, ``HYBRID_NO_KERNELS=1``) one line says why and the caller uses its exact
PyTorch fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger("hybrid")

CSRC = Path(__file__).resolve().parents[2] / "csrc"
_loaded: dict[str, object] = {}


def kernels_disabled() -> bool:
    return os.environ.get("HYBRID_NO_KERNELS", "0") not in ("", "0")


def cache_root() -> Path:
    env = os.environ.get("HYBRID_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybrid" / "kernels"


def _cpu_fingerprint() -> str:
    """-march=native code is only valid on the CPU it was built for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_extension(name: str, sources: list[str], *, cuda: bool = False,
                   cflags: list[str] | None = None, cuda_cflags: list[str] | None = None,
                   ldflags: list[str] | None = None):
    """The compiled module ``name`` built from ``csrc/<sources>``, or None.

    Never raises: a failed build logs one warning naming the reason. The result
    (module or None) is remembered for the life of the process.
    """
    if name in _loaded:
        return _loaded[name]
    mod = None
    reason = None
    if kernels_disabled():
        reason = "HYBRID_NO_KERNELS is set"
    elif cuda and not torch.cuda.is_available():
        reason = "no CUDA device"
    else:
        paths = [CSRC / s for s in sources]
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            reason = f"source not found: {missing[0]}"
        else:
            try:
                mod = _build(name, paths, cuda, cflags or [], cuda_cflags or [], ldflags or [])
            except Exception as e:  # compiler missing, compile error, bad .so ...
                first = str(e).strip().splitlines()
                reason = f"{type(e).__name__}: {first[-1] if first else ''}"[:300]
    if mod is None:
        quiet = kernels_disabled() or (cuda and not torch.cuda.is_available())
        (log.info if quiet else log.warning)(
            "hybrid: kernel %s not used (%s); using the PyTorch fallback", name, reason)
    _loaded[name] = mod
    return mod


def _build(name, paths, cuda, cflags, cuda_cflags, ldflags):
    from torch.utils import cpp_extension

    key = hashlib.sha256()
    for p in paths:
        key.update(p.read_bytes())
        # ninja's build file records absolute source paths: two checkouts sharing the
        # cache would otherwise rebuild each other's kernels on every switch
        key.update(str(p.resolve()).encode())
    key.update(repr((cflags, cuda_cflags, ldflags, torch.__version__, torch.version.cuda,
                     _cpu_fingerprint())).encode())
    build_dir = cache_root() / f"{name}-{key.hexdigest()[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(name=name, sources=[str(p) for p in paths], extra_cflags=cflags,
                  extra_ldflags=ldflags,
                  build_directory=str(build_dir), verbose=False)
    if cuda:
        kwargs["extra_cuda_cflags"] = cuda_cflags
    return cpp_extension.load(**kwargs)
