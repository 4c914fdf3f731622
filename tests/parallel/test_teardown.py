"""A finished run exits 0: the engine finishes what it has in flight at close, and the
process groups are torn down before the interpreter (hybrid/parallel/teardown.py).

Run as a script under torchrun, this file is the worker of
:func:`test_finished_api_run_exits_clean`: a tiny model through ``hybrid.initialize``,
a few ZeRO-3 steps, no close, no ``destroy_process_group``, as a user's script ends.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.helpers.harness import run_ranks
from tests.helpers.launch import env


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x).pow(2).mean()


def _gloo_threads() -> int:
    """This process's threads that gloo started (its process groups' workers and
    transport loop), by name."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += "gloo" in f.read()
        except OSError:  # (the thread ended meanwhile)
            pass
    return n


def _worker() -> None:
    import hybrid

    # registered before hybrid's exit hook, so it runs after it (atexit is LIFO)
    atexit.register(lambda: print(f"gloo threads at exit: {_gloo_threads()}",
                                  file=sys.stderr, flush=True))
    torch.manual_seed(0)
    engine, *_ = hybrid.initialize(_Net(), config={
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)))
        engine.step()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_finished_api_run_exits_clean():
    """2 ranks under torchrun: a script that trains through ``hybrid.initialize`` and
    just ends exits 0, no rank aborts ("terminate called without an active
    exception"), and no gloo thread is left when the interpreter finalizes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "2", os.path.abspath(__file__)]
    r = subprocess.run(cmd, capture_output=True, check=False, text=True, timeout=120, env=env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "terminate called" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("gloo threads at exit: 0") == 2, r.stderr[-3000:]


def _close_finishes(ps):
    """Stage 3: nothing in flight after a step; a forward of the first block alone
    leaves the next block's gather in flight; close() finishes it (and a second
    close does nothing). Then the state lets go of its groups: a collective raises."""
    from hybrid.config.sections import ZeroConfig
    from hybrid.zero import apply_zero

    torch.manual_seed(0)
    model = _Net()
    engine = apply_zero(model, ps, ZeroConfig(stage=3, param_persistence_threshold=0))
    x = torch.randn(2, 8)
    engine.backward(model(x))
    engine.step(1e-3)
    out = {"after_step": engine.in_flight()}
    with torch.no_grad():
        model.blocks[0](x)
    out["after_part"] = engine.in_flight()
    engine.close()
    out["after_close"] = engine.in_flight()
    engine.close()
    ps.release()
    try:
        ps.dp_group.all_reduce(torch.ones(1))
        out["after_release"] = "ran"
    except RuntimeError as e:
        out["after_release"] = str(e)
    return out


def test_close_finishes_what_is_in_flight():
    """2 ranks: see :func:`_close_finishes`."""
    for r in run_ranks(_close_finishes, world_size=2, tp=1):
        assert (r["after_step"], r["after_part"], r["after_close"]) == (0, 1, 0), r
        assert "released at teardown" in r["after_release"], r


if __name__ == "__main__":
    _worker()
