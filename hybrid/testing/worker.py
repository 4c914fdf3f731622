"""The worker side of :mod:`hybrid.testing.pool`: one pooled rank's loop.

A worker joins the default gloo group once, then runs calls one after another:
before each it puts back what a fresh process would have (:class:`_Fresh`),
builds a fresh :class:`~hybrid.parallel.state.ParallelState` over process
groups it keeps per TP size (:class:`_Layouts`), runs the function and sends
its result (moved to CPU) or its traceback back. See the pool's contract in
:mod:`hybrid.testing.pool`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import pickle
import sys
import time
import traceback

import torch
import torch.distributed as dist


class _Fresh:
    """What a fresh worker process looks like, captured once, put back before each call."""

    def __init__(self):
        self.rng = torch.get_rng_state()
        self.own_env = {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
                        "GLOO_SOCKET_IFNAME": os.environ["GLOO_SOCKET_IFNAME"]}
        self.anomaly = torch.is_anomaly_enabled()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.dtype = torch.get_default_dtype()
        logger = logging.getLogger("hybrid")
        self.log = (list(logger.handlers), logger.level, logger.propagate, logger.disabled)

    def restore(self, environ: dict, cwd: str, path: list[str]) -> None:
        environ = {**environ, **self.own_env}
        if os.environ != environ:
            os.environ.clear()
            os.environ.update(environ)
        with contextlib.suppress(OSError):
            os.chdir(cwd)
        sys.path[:] = path
        torch.set_rng_state(self.rng)
        import random
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.set_num_threads(1)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(self.anomaly)
        # torch.use_deterministic_algorithms also sets inductor's flag, importing
        # torch._inductor (dynamo, sympy: 1.3 s of CPU, more than the rest of a worker's
        # start): called only where a flag may differ, so a worker that never compiles
        # never imports it
        mode, warn_only = self.deterministic
        if "torch._inductor.config" in sys.modules or self.deterministic != (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()):
            torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        logger = logging.getLogger("hybrid")
        handlers, level, propagate, disabled = self.log
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled
        # This process's entry point: kernel settings from the (pool-keyed) HYBRID_*
        # variables, as a fresh process would take them, whatever the last call set.
        from hybrid.config import kernel_config_from_env
        from hybrid.kernels import configure
        configure(kernel_config_from_env(environ))


class _Layouts:
    """The TP/CP/DP/PP groups of one pool worker, created once per layout (a TP size, or
    a (TP, CP) pair, or a (TP, CP, PP) triple)."""

    def __init__(self, timeout: datetime.timedelta, store):
        self.timeout = timeout
        self.store = store
        self.built: dict = {}  # layout -> its groups
        # the calls' flight recorders share two store connections (their main thread's
        # and their heartbeat's; one call at a time): a fresh pair per call cost two
        # connects, and one in ~20 stalls for 5 s here
        self.connections = (store.clone(), store.clone())

    def state(self, layout, call_id: int):
        """A fresh ParallelState for call ``call_id``: fresh counters, a fresh flight
        recorder whose store keys are private to the call."""
        from hybrid.diagnostics.recorder import FlightRecorder
        from hybrid.parallel.comm import CommGroup, CommStats
        from hybrid.parallel.state import ParallelState

        tp, cp, pp, ep, etp = ((*layout, 1, 1, 1, 1)[:5] if isinstance(layout, tuple)
                               else (layout, 1, 1, 1, 1))
        key = (tp, cp, pp, ep, etp)
        if key not in self.built:  # collective: every rank sees the same calls in order
            _barrier(self.store, f"hybrid/pool/layout_{call_id}", dist.get_world_size())
            self.built[key] = ParallelState.build(tp, timeout=self.timeout,
                                                  device=torch.device("cpu"),
                                                  context_parallel_size=cp,
                                                  pipeline_model_parallel_size=pp,
                                                  expert_model_parallel_size=ep,
                                                  expert_tensor_parallel_size=etp)
        base, stats = self.built[key], CommStats()
        prefix = f"hybrid/call_{call_id}"
        rec = FlightRecorder(base.rank, base.world_size, dist.PrefixStore(prefix, self.store),
                             self.timeout, connections=tuple(
                                 dist.PrefixStore(prefix, c) for c in self.connections))

        def fresh(g):
            return CommGroup(g.name, g.pg, g.ranks, g.global_rank, stats, g.timeout, rec)

        dp = fresh(base.dp_group)
        dp_cp = dp if cp == 1 else fresh(base.dp_cp_group)
        ps = dataclasses.replace(base, tp_group=fresh(base.tp_group), dp_group=dp,
                                 cp_group=fresh(base.cp_group), dp_cp_group=dp_cp,
                                 pp_group=fresh(base.pp_group),
                                 embedding_group=fresh(base.embedding_group),
                                 ep_group=fresh(base.ep_group),
                                 edp_group=(dp_cp if ep == etp == 1
                                            else fresh(base.edp_group)),
                                 etp_group=fresh(base.etp_group),
                                 world_group=fresh(base.world_group), comm_stats=stats,
                                 recorder=rec)
        rec.start()
        return ps


# How long ranks may take to reach the same point while starting (imports, unpickling a
# call's function) on a loaded machine.
START_S = 120.0


def _barrier(store, key: str, world_size: int) -> None:
    """Wait until every rank has arrived at ``key``: creating a gloo group (or the default
    one) waits for all ranks only as long as the group's timeout, which can be shorter
    than a slow rank's imports."""
    store.add(key, 1)
    deadline = time.monotonic() + START_S
    while store.add(key, 0) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks did not all reach {key} within {START_S:.0f}s")
        time.sleep(0.01)


def worker_main(rank, world_size, port, collective_timeout, tasks, results):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    fresh = _Fresh()
    parent = os.getppid()
    layouts, init_error = None, None
    try:
        timeout = datetime.timedelta(seconds=collective_timeout)
        # The store waits as long as starting ranks may take; collectives time out after
        # ``collective_timeout``, which may be a few seconds (see _barrier).
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=max(collective_timeout,
                                                                     START_S)))
        _barrier(store, "hybrid/pool/init", world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        layouts = _Layouts(timeout, store)
    except BaseException:  # noqa: BLE001 - reported as the failure of every call
        init_error = traceback.format_exc()
    while True:
        try:
            while not tasks.poll(1.0):
                if os.getppid() != parent:  # orphaned: nobody will send more work
                    os._exit(0)
            task = tasks.recv()
        except (EOFError, OSError):  # the parent closed the pipe or died
            task = None
        if task is None:
            break
        call_id, payload = task
        if init_error is not None:
            results.put((call_id, rank, "error", init_error))
            continue
        assert layouts is not None  # (made unless init_error)
        reply: tuple | None  # (call id, rank, "ok" or "error", the pickled result or traceback)
        try:
            fn, tp, args, environ, cwd, path = pickle.loads(payload)
            fresh.restore(environ, cwd, path)
            ps = layouts.state(tp, call_id)
            try:
                out = fn(ps, *args)
            finally:
                ps.close()
                ps = None
            # Plain pickle copies tensor bytes; torch's queue pickler would share them
            # through file descriptors that vanish when this process exits.
            reply = (call_id, rank, "ok", pickle.dumps(_to_cpu(out)))
        except BaseException:  # noqa: BLE001 - shipped to the parent with the rank
            reply = (call_id, rank, "error", traceback.format_exc())
        fn = args = out = None
        results.put(reply)
        reply = None
        # This call's cycles (models, hooks) go now; the survivors (modules, caches,
        # process groups) are frozen so later passes walk only new objects: a full
        # pass over torch's ~300k objects costs ~0.15 s a call.
        gc.collect()
        gc.freeze()
    # Shutdown: drop groups, flush the result queue, and leave without interpreter
    # teardown (gloo threads torn down late can abort the process noisily).
    del layouts
    gc.collect()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


# -- parent side ------------------------------------------------------------------------

