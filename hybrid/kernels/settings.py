"""The kernel settings of this process, set once at start-up from the config.

    from hybrid.kernels import configure
    configure(cfg.kernels)       # scripts/pretrain_gpt.py, after validating the flags

Every op of :mod:`hybrid.kernels` reads :func:`current` when it picks a path or
loads an extension; nothing in the package reads the environment (the entry
points turn ``HYBRID_*`` variables into a :class:`KernelConfig` with
:func:`hybrid.config.kernel_config_from_env`). Until :func:`configure` is
called the defaults hold: kernels allowed, the default cache, no overrides.
"""

from __future__ import annotations

from hybrid.config.sections import KernelConfig

_current = KernelConfig()


def configure(cfg: KernelConfig) -> None:
    """Use ``cfg`` from now on in this process.

    A change of what decides *whether and where* extensions load (``no_kernels``,
    ``cache_dir``, ``cuda_arch_list``) takes effect at the next load: extensions
    are remembered per those settings (:func:`hybrid.kernels.build.load_extension`).
    """
    global _current  # noqa: PLW0603 - the process's settings; configure() is the one writer
    if not isinstance(cfg, KernelConfig):
        raise TypeError(f"configure() takes a KernelConfig, got {type(cfg).__name__}")
    _current = cfg


def current() -> KernelConfig:
    """The settings in force (see :func:`configure`)."""
    return _current
