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
_configured = False  # configure() was called in this process


def configure(cfg: KernelConfig) -> None:
    """Use ``cfg`` from now on in this process.

    A change of what decides *whether and where* extensions load (``no_kernels``,
    ``cache_dir``, ``cuda_arch_list``) takes effect at the next load: extensions
    are remembered per those settings (:func:`hybrid.kernels.build.load_extension`).
    """
    global _current, _configured  # noqa: PLW0603 - the process's settings; the one writer
    if not isinstance(cfg, KernelConfig):
        raise TypeError(f"configure() takes a KernelConfig, got {type(cfg).__name__}")
    _current, _configured = cfg, True


def configured() -> bool:
    """Whether an entry point has set this process's settings (:func:`configure`): a
    library door that is also an entry point (``hybrid.initialize``) sets them from the
    environment only when none has."""
    return _configured


def current() -> KernelConfig:
    """The settings in force (see :func:`configure`)."""
    return _current
