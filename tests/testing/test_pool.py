"""The worker pool behind run_ranks: calls share processes but start as fresh ones would."""

import logging
import os

import torch

from hybrid.testing import pool as multiprocess
from tests.helpers.harness import run_ranks


def _dirty(ps):
    """Leave behind what a call could: RNG, dtype, threads, grad mode, env, cwd, logger."""
    first = torch.rand(3)
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    os.environ["HYBRID_TEST_LEFTOVER"] = "1"
    os.chdir("/")
    logging.getLogger("hybrid").addHandler(logging.NullHandler())
    ps.comm_stats.add("all_reduce", 4)  # counted bytes of this call
    return os.getpid(), first


def _look(ps):
    return {"pid": os.getpid(), "rand": torch.rand(3), "dtype": torch.get_default_dtype(),
            "threads": torch.get_num_threads(), "grad": torch.is_grad_enabled(),
            "leftover": os.environ.get("HYBRID_TEST_LEFTOVER"), "cwd": os.getcwd(),
            "handlers": len(logging.getLogger("hybrid").handlers),
            "bytes": dict(ps.comm_stats.bytes), "flag": os.environ.get("POOL_TEST_FLAG")}


def test_a_call_starts_as_in_a_fresh_process_on_the_same_processes(monkeypatch):
    pids, firsts = zip(*run_ranks(_dirty, world_size=2))
    monkeypatch.setenv("POOL_TEST_FLAG", "seen")  # not process-level: same pool, passed on
    for r, pid, first in zip(run_ranks(_look, world_size=2), pids, firsts):
        assert r["pid"] == pid
        assert torch.equal(r["rand"], first)  # the generator's state at process start
        assert r["dtype"] == torch.float32 and r["threads"] == 1 and r["grad"]
        assert r["leftover"] is None and r["cwd"] == os.getcwd()
        assert r["handlers"] == 0
        assert not any(r["bytes"].values())
        assert r["flag"] == "seen"


def test_pools_are_keyed_on_process_level_variables_only(monkeypatch):
    key = multiprocess._env_key()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")  # torch sets it itself
    monkeypatch.setenv("POOL_TEST_FLAG", "x")
    assert multiprocess._env_key() == key
    monkeypatch.setenv("HYBRID_NO_KERNELS", "1")  # read once into the kernel cache
    assert multiprocess._env_key() != key
