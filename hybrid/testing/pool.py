"""Run a function on N ranks as separate processes (gloo, 127.0.0.1).

The shared launcher of every multi-rank test (``tests/helpers/harness.py``) and of the
benches in ``benchmarks/``, which need ranks without torchrun.

    results = run_ranks(fn, world_size=4, tp=2, args=(...))

``fn(ps, *args)`` runs on every rank with a :class:`hybrid.parallel.state.ParallelState`
built for ``tp``; the list of its return values (moved to CPU, indexed by global
rank) comes back. A worker that raises fails the test with that rank's
traceback; a worker that hangs fails it after ``timeout`` seconds, and every
collective inside times out after ``collective_timeout`` seconds.

The rendezvous store is hosted by the calling process on 127.0.0.1 with an
OS-chosen free port, so parallel test runs never collide.

[Note: the worker pool]
Starting a rank (a Python process that imports torch and joins a gloo group)
costs seconds, far more than most calls, so ranks are kept: the first call for
a world size spawns a *pool* of ``world_size`` workers, and later calls with the
same world size, ``collective_timeout`` and process-level environment (below)
run on the same processes, one call after another. The contract:

* Each call gets a fresh :class:`ParallelState` for its ``tp`` with fresh
  :class:`hybrid.parallel.comm.CommStats` (byte counts start at zero) and a fresh
  flight recorder (collective numbers start at zero; its store keys live under
  ``hybrid/call_<n>/``, reached through two store connections each worker makes
  once -- a connect to the store stalls for 5 s about once in 20 on the CI
  machine; its heartbeat stops when the call returns). The process
  groups under it are created once per ``tp`` in a pool and reused; the default
  group lives as long as the pool.
* Before each call a worker puts back what a fresh process would have: the
  torch CPU generator's initial state (and fresh entropy for ``random`` and
  numpy's global generator), one intra-op thread, float32 default dtype, grad
  mode on, anomaly detection and deterministic algorithms as at start, the
  caller's environment variables (as of this call), working directory and
  ``sys.path``, and the ``hybrid`` logger's handlers and level. After each call
  (its reply sent) it runs the garbage collector, so models, hooks and buffers
  of one call do not outlive it, then freezes what survived (``gc.freeze``).
* A pool is also keyed by the caller's *process-level* variables, those read
  once per process into caches (``HYBRID_*``: the kernel settings, which a worker
  takes as its entry point from :func:`hybrid.config.kernel_config_from_env` and
  puts back before each call;
  ``TORCH_*``, ``OMP_*``, ``GLOO_*``, ``PYTHON*`` ...; see ``_PROCESS_ENV``): a
  call made with ``HYBRID_NO_KERNELS=1``, say, gets its own pool, spawned with
  that environment, so those caches are what a fresh process would have. Other
  variables (set by a test, or by torch in the caller, as
  ``TORCHINDUCTOR_CACHE_DIR``) reach the call through the previous point
  without a new pool.
* If any rank raises, dies or runs past ``timeout``, the whole pool is killed
  (the other ranks may be stuck in a collective) and the error is reported as
  before, with the rank's traceback; the next call spawns a new pool.
* Ranks meet in the store (a barrier allowing :data:`hybrid.testing.worker.START_S` seconds) before
  the default group and each layout's groups are created, so a
  ``collective_timeout`` of a few seconds bounds collectives, not start-up.
* ``reuse=False`` runs the call on throwaway processes that exit afterwards:
  for calls that deliberately hang, stop or kill a rank, or leave a collective
  unmatched, and for measurements that need a fresh process (peak RSS).
* Pools are shut down at interpreter exit (``atexit``) or by
  :func:`shutdown_pools`; a worker whose parent dies exits on its own.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import pickle
import queue
import sys
import time
from multiprocessing.reduction import ForkingPickler

import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid.testing.worker import worker_main

# At most this many idle pooled workers are kept; older pools are shut down first. Ten
# hold the suite's pools of 1, 2 and 4 ranks and an extra environment's pool of 2 (about
# 0.4 GB each) without respawning one; eight more let the one test of 8 ranks (the
# pipeline's proof grid, which closes its pool when done: close_pools) start beside
# them instead of shutting them all down.
MAX_POOLED_WORKERS = 18


def _context():
    """Workers fork from a server that has imported torch once (about 2 s of CPU per
    worker saved on a 2-core machine); a fresh interpreter each, as with spawn, but
    for the import. Nothing of hybrid is preloaded: a worker reads its environment
    (e.g. HYBRID_NO_KERNELS) when it imports the package."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


# -- caller side ------------------------------------------------------------------------
class _Pool:
    """``world_size`` worker processes sharing one default process group."""

    def __init__(self, world_size: int, collective_timeout: float):
        ctx = _context()
        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                   wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=collective_timeout))
        self.results = ctx.Queue()
        self.conns, self.procs = [], []
        for r in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(r, world_size, self.store.port,
                                                  collective_timeout, recv, self.results),
                            daemon=True)
            p.start()
            recv.close()  # the worker holds it now; our copy would mask its EOF
            self.conns.append(send)
            self.procs.append(p)
        self.calls = 0
        self.last_used = time.monotonic()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, tp, args, timeout, early_exit=None, grace_s=0.0):
        """Results by rank; raises (after killing the pool) on any rank's failure."""
        self.calls += 1
        call_id = self.calls
        # Pickled here, unpickled inside the worker's try: an unimportable ``fn``
        # comes back as that rank's error. Tensors in ``args`` travel as shared memory.
        task = (call_id, bytes(ForkingPickler.dumps((fn, tp, args, dict(os.environ),
                                                     os.getcwd(), list(sys.path)))))
        try:
            for c in self.conns:
                c.send(task)
        except (OSError, ValueError) as e:
            self.kill()
            raise RuntimeError(f"the worker pool for world size {self.world_size} is "
                               f"gone ({e})") from e
        out: dict[int, object] = {}  # rank -> its result
        errors = []
        deadline = time.monotonic() + timeout
        stop_by = None  # set when a result asks to stop the rest (early_exit)
        try:
            while len(out) < self.world_size:
                now = time.monotonic()
                if stop_by is not None and now >= stop_by:
                    self.kill()  # as torchrun stops a job after one worker's failure
                    return [out.get(r) for r in range(self.world_size)]
                left = deadline - now
                if left <= 0:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(self.world_size)) - set(out))} did not "
                        f"finish within {timeout}s")
                wait = min(left, 1.0) if stop_by is None else min(left, stop_by - now, 1.0)
                try:
                    cid, rank, status, payload = self.results.get(timeout=max(wait, 0.01))
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs)
                            if p.exitcode is not None and r not in out]
                    if dead:
                        raise RuntimeError(f"rank(s) {dead} died with exit codes "
                                           f"{[self.procs[r].exitcode for r in dead]}"
                                           ) from None  # the empty queue is not the cause
                    continue
                if cid != call_id:
                    continue  # cannot happen: a failed call's pool is not reused
                if status != "ok":
                    errors.append((rank, payload))
                    break  # the others may be blocked on the failed rank
                out[rank] = pickle.loads(payload)
                if early_exit is not None and stop_by is None and early_exit(out[rank]):
                    stop_by = time.monotonic() + grace_s
        except BaseException:
            self.kill()
            raise
        if errors:
            self.kill()
            rank, tb = errors[0]
            raise AssertionError(f"rank {rank} failed:\n{tb}")
        self.last_used = time.monotonic()
        return [out[r] for r in range(self.world_size)]

    def close(self, wait: float = 5.0) -> None:
        """Ask the workers to exit; kill those that have not within ``wait`` seconds."""
        for c in self.conns:
            with contextlib.suppress(OSError, ValueError):
                c.send(None)
        deadline = time.monotonic() + wait
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.conns = []
        self.results.close()
        self.results.cancel_join_thread()
        if self in _POOLS.values():
            for k in [k for k, v in _POOLS.items() if v is self]:
                del _POOLS[k]


_POOLS: dict[tuple, _Pool] = {}


# Environment variables read once per process (at import or into a cache), by the
# library (kernel loading), torch, OpenMP/MKL, gloo or the interpreter.
_PROCESS_ENV = ("HYBRID_", "XDG_", "HOME", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "KMP_",
                "GLOO_", "NCCL_", "CUDA_", "LD_", "PYTHON")


def _env_key() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_PROCESS_ENV)))


def _pool(world_size: int, collective_timeout: float) -> _Pool:
    key = (world_size, float(collective_timeout), _env_key())
    pool = _POOLS.get(key)
    if pool is not None and not pool.alive:
        pool.kill()
        pool = None
    if pool is None:
        # Bound the idle processes: shut down the least recently used pools first.
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > \
                MAX_POOLED_WORKERS:
            min(_POOLS.values(), key=lambda p: p.last_used).close()
        pool = _POOLS[key] = _Pool(world_size, collective_timeout)
    return pool


def close_pools(world_size: int) -> None:
    """Stop the pooled workers of every pool of ``world_size`` ranks (a size one test
    uses alone: its memory back at once)."""
    for pool in [p for p in _POOLS.values() if p.world_size == world_size]:
        pool.close()


def shutdown_pools() -> None:
    """Stop every pooled worker (also done at interpreter exit)."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_pools)


def run_ranks(fn, world_size: int, tp: int = 1, args: tuple = (), timeout: float = 240,
              collective_timeout: float = 60, reuse: bool = True, early_exit=None,
              grace_s: float = 5.0, cp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1):
    """Run ``fn(ps, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``tp``, ``cp``, ``pp``: the TP, CP and PP sizes of ``ps`` (DP is what is left);
    ``ep``, ``etp``: its expert-parallel and expert-tensor-parallel sizes.

    ``fn`` must be importable by name (a module-level function) for spawn.
    ``reuse=False``: throwaway processes (see the module docstring).
    ``early_exit(result) -> bool``: when a rank's result satisfies it, ranks that
    have not finished ``grace_s`` seconds later are killed with their pool and
    come back as None -- what torchrun does to a job one of whose workers failed.
    """
    layout = (tp if cp == pp == ep == etp == 1 else (tp, cp) if pp == ep == etp == 1
              else (tp, cp, pp) if ep == etp == 1 else (tp, cp, pp, ep) if etp == 1
              else (tp, cp, pp, ep, etp))
    if not reuse:
        pool = _Pool(world_size, collective_timeout)
        try:
            return pool.run(fn, layout, args, timeout, early_exit, grace_s)
        finally:
            pool.close()
    pool = _pool(world_size, collective_timeout)
    return pool.run(fn, layout, args, timeout, early_exit, grace_s)
