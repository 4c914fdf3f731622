"""The nvme tier's speculative update of the read-ahead tiles (hybrid/zero/offload/host_step.py,
[Note: what starts before the step]): a step that keeps it and a step that discards it both
leave every state element and parameter bit-identical to a step that never speculated.

One process (the speculation is the engine's: ``prefetch_step(lr)`` after the last backward,
as the pipeline step calls it), ZeRO 2, tiles of 1024 elements, the first two read ahead
and speculated on (``--offload-buffer-count`` 3). Three regimes: the clip does not bind
(every step uses the speculation), it binds (the steps that speculate discard it, and
sit out the next), and an fp16 step that overflows (skipped: discarded).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import InitValues
from hybrid.zero import apply_zero
from tests.helpers.zero_reference import _gpt, _my_micro_batches, _train_cfg

TILE, BUFFERS, STEPS = 1024, 3, 3
AHEAD = BUFFERS - 1  # tiles read ahead, so speculated, per step


def _train(root: str, speculate: bool, blow_up: int | None, settle: bool = False,
           **kw) -> dict:
    """STEPS steps; ``blow_up``: the step whose loss is scaled past fp16's range (its
    gradients overflow: a skipped step); ``settle``: each speculation runs to its end
    before the step (else the step races it, and may stop it early: [Note: a speculation
    the step has outrun]). Returns the whole shard's states, the parameters (their own
    dtype), the skip flags and the speculation counts."""
    ps = ParallelState.single()
    cfg = _train_cfg(1, 1, zero_stage=2, offload_optimizer="nvme", offload_nvme_path=root,
                     offload_buffer_size=TILE, offload_buffer_count=BUFFERS, **kw)
    model = _gpt(cfg, ps, device="meta")
    offload = dataclasses.replace(cfg.offload, speculative_step=speculate)
    engine = apply_zero(model, ps, cfg.zero, adamw=cfg.adamw, precision=cfg.precision,
                        offload=offload, values=InitValues(cfg.seed, model.init_of))
    lr, skipped = cfg.lr_schedule.lr, []
    try:
        for step in range(STEPS):
            engine.zero_grad()
            batches = _my_micro_batches(step, ps, cfg.loop.micro_batch_size)
            for i, (x, y) in enumerate(batches):
                loss = model(x, y) / len(batches)  # (backward scales it for fp16)
                if step == blow_up:
                    loss = loss * 1e30
                engine.backward(loss, sync=i == len(batches) - 1)
            engine.prefetch_step(lr)  # (off: only the read-ahead)
            if settle:
                engine.offload.speculative.settle()
            skipped.append(bool(engine.step(lr).skipped))
        n = engine.optimizer.states.n
        states = {k: engine.optimizer.states.read_range(k, 0, n)
                  for k in ("master", "exp_avg", "exp_avg_sq")}
        with engine.gathered():
            params = {name: p.detach().clone() for name, p in model.named_parameters()}
        return {"states": states, "params": params, "skipped": skipped,
                "counts": engine.offload_speculation(), "tiles": engine.optimizer.states.tiles}
    finally:
        engine.close()


# (started: the steps that speculate. After one whose speculation the step did not use,
# the next sits out: [Note: sitting out while the clip binds] in speculative.py)
@pytest.mark.parametrize("regime, kw, blow_up, started, used", [
    ("clip does not bind", dict(clip_grad=1e4), None, STEPS, STEPS),
    ("clip binds", dict(clip_grad=1e-6), None, 2, 0),  # steps 1 and 3; step 2 sits out
    ("fp16, step 2 overflows", dict(fp16=True, clip_grad=0.0, hysteresis=1), 1, 2, 1),
])
def test_the_speculative_update_is_bit_identical_kept_or_discarded(tmp_path, regime, kw,
                                                                    blow_up, started, used):
    plain = _train(str(tmp_path / "plain"), False, blow_up, **kw)
    assert plain["tiles"] > AHEAD, regime  # (tiles after the read-ahead ones: loop both)
    assert plain["skipped"] == [s == blow_up for s in range(STEPS)], regime
    assert plain["counts"] == {}, regime  # (off: nothing speculated, nothing counted)
    for settle in (True, False):
        spec = _train(str(tmp_path / f"spec{settle}"), True, blow_up, settle, **kw)
        what = (regime, "settled" if settle else "raced")
        assert spec["skipped"] == plain["skipped"], what
        for key, a in plain["states"].items():
            assert torch.equal(a.view(torch.int32), spec["states"][key].view(torch.int32)), \
                (what, key)
        assert plain["params"].keys() == spec["params"].keys()
        for name, a in plain["params"].items():
            b = spec["params"][name]
            assert a.dtype == b.dtype and torch.equal(a, b), (what, name)
        counts = spec["counts"]
        if settle:  # every speculation whole, then used or discarded by the step
            assert counts == {"speculated": started * AHEAD, "used": used * AHEAD,
                              "discarded": (started - used) * AHEAD}, (what, counts)
        else:  # (one the step outruns stops early: discarded, the tiles it had done)
            assert counts["used"] == used * AHEAD, (what, counts)
            assert counts["speculated"] == counts["used"] + counts["discarded"], (what, counts)
            assert counts["speculated"] <= started * AHEAD, (what, counts)


def test_a_binding_clip_is_tried_again_after_ever_longer_sit_outs():
    """[Note: sitting out while the clip binds]: each unused speculation doubles the steps
    the next ones sit out (1, 2, 4, ..., at most MAX_SIT_OUT); one used again resets
    them. Driven through SpeculativeUpdate with a stand-in optimizer whose step judges
    each speculation as told."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from hybrid.zero.offload.nvme.speculative import MAX_SIT_OUT, SpeculativeUpdate

    counts = {"speculated": 0, "used": 0, "discarded": 0}
    opt = SimpleNamespace(speculation=counts, states=SimpleNamespace(read_ahead=[0], tile=4),
                          speculative_scalars=lambda c: c,
                          speculate=lambda *a, **k: None, drop_speculation=lambda: None)
    grads = SimpleNamespace(wait_units=lambda units: None)
    with ThreadPoolExecutor(1) as worker:
        spec = SpeculativeUpdate(opt, grads, worker, [[0]], dtype=torch.float32, pin=False)

        def steps(n: int, kept: bool) -> list[int]:
            started = []
            for i in range(n):
                before = spec._task
                spec.start(1e-3, 1.0, [True])
                if spec._task is not before:
                    started.append(i)
                    counts["used" if kept else "discarded"] += 1  # (the step's verdict)
                spec.end(keep=True)
            return started

        assert steps(40, kept=False) == [0, 2, 5, 10, 19, 36]  # sit-outs 1, 2, 4, 8, 16
        assert steps(3, kept=True) == []  # (the sit-out of 32 still running)
        spec._sit_out = 0
        assert steps(3, kept=True) == [0, 1, 2]  # used: no sit-out at all
        assert steps(4, kept=False) == [0, 2]  # reset: 1 step, then 2
        assert spec._next_sit_out == 4 <= MAX_SIT_OUT
