"""Run a function on N ranks as separate processes (gloo, 127.0.0.1).

The shared launcher of every multi-rank test (``tests/harness.py``) and of the
benchmark scripts, which need ranks without torchrun.

    results = run_ranks(fn, world_size=4, tp=2, args=(...))

``fn(ps, *args)`` runs on every rank with a :class:`hybrid.parallel_state.ParallelState`
built for ``tp``; the list of its return values (moved to CPU, indexed by global
rank) comes back. A worker that raises fails the test with that rank's
traceback; a worker that hangs fails it after ``timeout`` seconds, and every
collective inside times out after ``collective_timeout`` seconds.

The rendezvous store is hosted by the test process on 127.0.0.1 with an
OS-chosen free port, so parallel test runs never collide.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, port, tp, fn, args, results, collective_timeout):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        from hybrid.parallel_state import ParallelState

        timeout = datetime.timedelta(seconds=collective_timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        ps = ParallelState.build(tp, timeout=timeout, device=torch.device("cpu"))
        out = fn(ps, *args)
        # Plain pickle copies tensor bytes; torch's queue pickler would share them
        # through file descriptors that vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(_to_cpu(out))))
    except BaseException:  # noqa: BLE001 - shipped to the parent with the rank
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def run_ranks(fn, world_size: int, tp: int = 1, args: tuple = (), timeout: float = 240,
              collective_timeout: float = 60):
    """Run ``fn(ps, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable by name (a module-level function) for spawn.
    """
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=collective_timeout))
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker,
                         args=(r, world_size, store.port, tp, fn, args, results,
                               collective_timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(out) + len(errors) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} did not "
                                   f"finish within {timeout}s")
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in out]
                if dead and not errors:
                    raise RuntimeError(f"rank(s) {dead} died with exit codes "
                                       f"{[procs[r].exitcode for r in dead]}")
                continue
            if status == "ok":
                out[rank] = pickle.loads(payload)
            else:
                errors.append((rank, payload))
                break  # the others may be blocked on the failed rank
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        rank, tb = errors[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return [out[r] for r in range(world_size)]
