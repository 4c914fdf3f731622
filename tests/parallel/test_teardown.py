"""A finished run exits 0: the engine finishes what it has in flight at close, and the
process groups are torn down before the interpreter (hybrid/parallel/teardown.py).

That a launched script which trains a few ZeRO-3 steps and just ends (no close, no
``destroy_process_group``, as users' scripts end) exits 0 with no gloo thread left at
exit is checked on the launch tests/hybrid_deepspeed/test_launcher.py already makes (its
script trains through ``deepspeed.initialize``, hybrid's engine): a launch of its own
here cost three more processes importing torch.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers.harness import run_ranks


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x).pow(2).mean()


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

