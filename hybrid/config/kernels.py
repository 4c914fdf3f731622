"""The kernel flags' parsing, and the one place the kernel settings are read from the
environment (torch-free, like :mod:`hybrid.config`, which re-exports both).

``--kernel-choice`` and ``HYBRID_KERNEL_CHOICE`` share :func:`parse_kernel_choice`;
:func:`kernel_config_from_env` turns ``HYBRID_*`` into a
:class:`~hybrid.config.sections.KernelConfig` for the entry points that take no
flags (pool workers, tests, tools) and as the defaults of TrainConfig's flags.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hybrid.config.sections import KERNEL_PATHS, KernelConfig
from hybrid.errors import ConfigError


def parse_kernel_choice(text: str, source: str) -> tuple[tuple[str, str], ...]:
    """``"op=path,..."`` -> ``((op, path), ...)``; ``all=path`` sets every op that has
    that path. A bad entry is a ConfigError naming ``source`` (the flag or variable)."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        op, _, path = (x.strip() for x in item.partition("="))
        ops = [o for o, paths in KERNEL_PATHS.items() if path in paths] if op == "all" else [op]
        if not ops or any(path not in KERNEL_PATHS.get(o, ()) for o in ops):
            choices = "; ".join(f"{o}: {'/'.join(p)}" for o, p in KERNEL_PATHS.items())
            raise ConfigError(f"{source}: bad entry {item!r}; expected op=path, op one of "
                              f"{', '.join(KERNEL_PATHS)} or all, with its paths ({choices})")
        out.update(dict.fromkeys(ops, path))
    return tuple(out.items())


def kernel_config_from_env(env: Mapping[str, str]) -> KernelConfig:
    """The kernel settings the environment ``env`` asks for: the one place that reads
    them. ``env`` is passed in by an entry point (a script's ``os.environ``, a pool
    worker's copy of its caller's): nothing in the library looks it up itself.

    ``HYBRID_NO_KERNELS`` (anything but "" or "0": no compiled kernel),
    ``HYBRID_KERNEL_CACHE`` (else ``$TORCH_EXTENSIONS_DIR/hybrid``, torch's variable for
    where JIT extensions build, which DeepSpeed's users set to move its ops; else
    ``$XDG_CACHE_HOME/hybrid/kernels``),
    ``HYBRID_KERNEL_CHOICE`` (as --kernel-choice) and ``TORCH_CUDA_ARCH_LIST`` (what a
    CUDA build targets). Entry points that take no flags -- pool workers, tests,
    tools -- configure :mod:`hybrid.kernels` from this; ``build_config(...,
    environ=)`` uses it as the default of the kernel flags.
    """
    cache = env.get("HYBRID_KERNEL_CACHE")
    if not cache and env.get("TORCH_EXTENSIONS_DIR"):
        cache = os.path.join(env["TORCH_EXTENSIONS_DIR"], "hybrid")
    if not cache and env.get("XDG_CACHE_HOME"):
        cache = os.path.join(env["XDG_CACHE_HOME"], "hybrid", "kernels")
    return KernelConfig(no_kernels=env.get("HYBRID_NO_KERNELS", "0") not in ("", "0"),
                        cache_dir=cache or None,
                        choice=parse_kernel_choice(env.get("HYBRID_KERNEL_CHOICE", ""),
                                                   "HYBRID_KERNEL_CHOICE"),
                        cuda_arch_list=env.get("TORCH_CUDA_ARCH_LIST") or None)
