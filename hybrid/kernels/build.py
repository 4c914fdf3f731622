"""Build and load the C++/CUDA extensions in ``csrc/``, or say why not.

    mod = load_extension("hybrid_cpu_ops", ["cpu_adam.cpp", "aio.cpp"])   # module or None

Each extension is compiled once with ``torch.utils.cpp_extension.load`` (ninja)
into a cache directory keyed by :func:`cache_key` -- its sources and their
paths, flags, the torch and CUDA versions, the CPU, and for a CUDA build the
GPU's compute capability and ``TORCH_CUDA_ARCH_LIST`` -- so later processes,
and every rank of a job, import the cached library, and a cache shared by
machines never hands one GPU architecture the binary built for another.

[Note: one builder, and a build killed mid-way]
cpp_extension guards a build directory with a "baton": a ``lock`` file created
when a build starts and deleted when it ends. A build killed mid-way (kill -9, a
lost node, Ctrl-C at the wrong moment) leaves the file, and every later run waits
on it forever with an empty log. So a build here first takes an ``flock`` on
``.hybrid-build.lock`` in that directory, which the kernel releases when its
holder dies, and writes its pid and host there. Whoever holds the flock is the
only process that can be inside cpp_extension's build for that directory, so a
baton it finds was left by a build that died: it is deleted, with one warning
naming the file and the dead builder. A live builder is waited on, with one line
naming the lock and the holder's pid. The build itself says one line when it
starts and one when it ends, with the time, where the user sees it: a first
offload run compiles for minutes, and silence looks like a hang.
``python -m hybrid.kernels`` builds the CPU kernels ahead of time.

Nothing here is required: when a kernel cannot build or load (no compiler, no
GPU, ``KernelConfig.no_kernels``) one line says why and the caller uses its
exact PyTorch fallback. Where the cache lives and whether kernels load at all
come from :func:`hybrid.kernels.settings.current`, never from the environment.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from hybrid.kernels import settings

log = logging.getLogger("hybrid")

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# (name, what decides whether and where it loads) -> module or None: a change of
# settings (hybrid.kernels.configure) decides anew instead of reusing a refusal.
_loaded: dict[tuple, object] = {}


def kernels_disabled() -> bool:
    return settings.current().no_kernels


def cache_root() -> Path:
    configured = settings.current().cache_dir
    return Path(configured) if configured else Path.home() / ".cache" / "hybrid" / "kernels"


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
    (module or None) is remembered for the life of the process, per kernel settings.
    """
    cfg = settings.current()
    key = (name, cfg.no_kernels, cfg.cache_dir, cfg.cuda_arch_list)
    if key in _loaded:
        return _loaded[key]
    mod = None
    reason = None
    if kernels_disabled():
        reason = "kernels are off (--no-kernels / HYBRID_NO_KERNELS)"
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
    _loaded[key] = mod
    return mod


def cache_key(paths: list[Path], flags: tuple, *, cuda: bool,
              capability: tuple[int, int] | None, arch_list: str | None,
              torch_version: str, cuda_version: str | None, cpu: str) -> str:
    """16 hex digits naming one build: what went in and what it can run on.

    ``capability`` (the GPU's ``(major, minor)``) and ``arch_list``
    (``TORCH_CUDA_ARCH_LIST``) choose the code nvcc emits, so they key CUDA builds:
    an sm_90 binary loads on sm_80 and fails at its first launch. A CPU-only build
    ignores both.
    """
    key = hashlib.sha256()
    for p in paths:
        key.update(p.read_bytes())
        # ninja's build file records absolute source paths: two checkouts sharing the
        # cache would otherwise rebuild each other's kernels on every switch
        key.update(str(p.resolve()).encode())
    target = (capability, arch_list) if cuda else None
    key.update(repr((flags, torch_version, cuda_version, cpu, target)).encode())
    return key.hexdigest()[:16]


def build_dir_of(name: str, paths: list[Path], cuda: bool, cflags: list[str],
                 cuda_cflags: list[str], ldflags: list[str]) -> Path:
    """The cache directory of one build (:func:`cache_key`), under :func:`cache_root`."""
    capability = torch.cuda.get_device_capability(torch.cuda.current_device()) if cuda else None
    digest = cache_key(paths, (cflags, cuda_cflags, ldflags), cuda=cuda, capability=capability,
                       arch_list=settings.current().cuda_arch_list,
                       torch_version=torch.__version__, cuda_version=torch.version.cuda,
                       cpu=_cpu_fingerprint())
    return cache_root() / f"{name}-{digest}"


def _build(name, paths, cuda, cflags, cuda_cflags, ldflags):
    from torch.utils import cpp_extension

    build_dir = build_dir_of(name, paths, cuda, cflags, cuda_cflags, ldflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(name=name, sources=[str(p) for p in paths], extra_cflags=cflags,
                  extra_ldflags=ldflags,
                  build_directory=str(build_dir), verbose=False)
    if cuda:
        kwargs["extra_cuda_cflags"] = cuda_cflags
    with build_lock(build_dir, name):
        built = (build_dir / f"{name}.so").exists()
        if not built:
            log.warning("hybrid: building kernel %s in %s (once; later runs load it)",
                        name, build_dir)
        start = time.monotonic()
        mod = cpp_extension.load(**kwargs)
        if not built:
            log.warning("hybrid: built kernel %s in %.0f s", name, time.monotonic() - start)
    return mod


LOCK = ".hybrid-build.lock"
BATON = "lock"  # cpp_extension's own, created and deleted around its build


@contextlib.contextmanager
def build_lock(build_dir: Path, name: str, *, poll_s: float = 0.2) -> Iterator[None]:
    """Hold ``build_dir``'s build lock (the Note above): an ``flock`` on ``LOCK``, which
    dies with its holder. Waits for a live holder, saying so once (its pid, from the
    file); a baton cpp_extension left behind, found while holding the lock, belongs
    to a build that died and is deleted, with a warning naming it."""
    path = build_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    log.info("hybrid: waiting for %s, which builds kernel %s (lock %s)",
                             _holder(path), name, path)
                    said = True
                time.sleep(poll_s)
        baton = build_dir / BATON
        if baton.exists():
            log.warning("hybrid: kernel %s: %s was left by a build that did not finish (%s, "
                        "no longer running); taking it over and building again",
                        name, baton, _holder(path))
            baton.unlink()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _holder(path: Path) -> str:
    """Who last took the lock at ``path``, as it wrote itself down."""
    try:
        said = path.read_text().strip()
    except OSError:
        said = ""
    return said or "another process"
