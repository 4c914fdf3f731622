"""DeepSpeed 0.19.8's fp16 checkpoints into hybrid, and hybrid's fp16 run back into DeepSpeed.

The fixtures ``net_fp16_zero0`` (FP16_UnfusedOptimizer), ``net_fp16_zero2`` and
``net_fp16_zero3`` were recorded by DeepSpeed itself on the CPU under the documented patch
of benchmarks/peers/deepspeed_fp16.py (its accelerator's fp16 query answers True), with
dynamic loss scaling from 2**18: ZeRO 2 and 3 overflowed at steps 0 and 1 (saved at scale
2**17, one overflow left before the next halving), and overflow again at step 4 after the
save. hybrid continues each under its fp16 (fp32 masters, the loss scale carried over)
with DeepSpeed's 10 losses, at DP 2 at DeepSpeed's stage and at others; at DP 1 the
overflows are the layout's own (below). The masters, moments and scale come over exactly.
"""

from __future__ import annotations

import json
import os

import torch

from tests.checkpoint.test_peer_deepspeed import (
    FIXTURES,
    TOLERANCE,
    _after,
    _copy,
    _deepspeed_bf16_stage0_values,
    _deepspeed_full_values,
    _recorder,
    _worst,
)


def _fp16():
    import importlib.util
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "benchmarks", "peers", "deepspeed_fp16.py")
    spec = importlib.util.spec_from_file_location("deepspeed_fp16", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recorded(name: str) -> dict:
    with open(os.path.join(FIXTURES, name, "losses.json")) as f:
        return json.load(f)


def _fp16_step(engine, ps, step: int) -> float:
    """The recorder's fp16 step of batch ``step`` on this DP rank's rows: the global loss."""
    rec, f16 = _recorder(), _fp16()
    per, rank, world = rec.GLOBAL_BATCH // ps.dp_size, ps.dp_rank, ps.dp_size
    x, y = rec.batch(step)
    rows = slice(rank * per, (rank + 1) * per)
    loss = f16.fp16_loss(rec.loss_of, engine, x[rows], y[rows])
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone().reshape(1)
    if world > 1:
        ps.world_group.all_reduce(mean)
    return float(mean) / world


def _fp16_continue(ps, load_dir: str, stage: int) -> dict:
    """A DeepSpeed user's fp16 script under hybrid at ZeRO ``stage``: the fixture's
    ds_config, load_checkpoint, 10 steps; the losses, the scale before each step and the
    skipped-step count after each."""
    from hybrid import deepspeed
    rec, f16 = _recorder(), _fp16()
    torch.manual_seed(123)  # other initial weights: the load must replace them all
    net = rec.Net()
    config = {**f16.fp16_config(rec.config(stage))}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=config, mpu=ps)
    assert net.fc1.weight.dtype == torch.float16
    engine.load_checkpoint(load_dir)
    assert (engine.global_steps, engine.global_samples) == (3, 24)
    out: dict = {"losses": [], "scales": [], "skipped": []}
    for step in range(rec.SAVED_AT, rec.SAVED_AT + rec.CONTINUED):
        out["scales"].append(float(engine.zero.scaler.scale))
        out["losses"].append(_fp16_step(engine, ps, step))
        out["skipped"].append(int(engine.skipped_steps))
    engine.close()
    return out


def _fp16_cases(ps, cases):
    return [_fp16_continue(ps, d, stage) for d, stage in cases]


# DeepSpeed 0.19.8 without ZeRO does not scale an fp16 loss (engine.backward scales it only
# for a ZeROOptimizer, and FP16_UnfusedOptimizer is not one) but FP16_UnfusedOptimizer still
# divides the gradients by its scale before Adam: net_fp16_zero0's DeepSpeed run steps on
# gradients 2**18 times too small (Adam's eps then weighs in) and never overflows. hybrid
# scales the loss, overflows at 2**18 (steps 3 and 4, halving to 2**16) and steps on the
# true gradients: its losses leave DeepSpeed's after the first (measured 1.4e-2 at worst).
ZERO0_BOUND = 2e-2


def test_deepspeed_fp16_checkpoints_continue_at_two_ranks(tmp_path):
    """Each fp16 fixture continued at DP 2 under hybrid's fp16 with its loss scale: at
    DeepSpeed's stage and at another (ZeRO 2's at 3 and 0, ZeRO 3's at 1, ZeRO 0's at 2),
    one launch. ZeRO 2-3: the 10 losses are DeepSpeed's within 2e-6 (measured: equal),
    each step's loss scale is DeepSpeed's, and the step DeepSpeed skipped (the overflow
    at step 4, which halves at once: the carried hysteresis is spent; a run starting
    afresh from 2**18 would skip steps 3 and 4) is skipped. ZeRO 0: the carried scale is
    DeepSpeed's, the first loss equal, the rest within :data:`ZERO0_BOUND` (above)."""
    from tests.helpers.harness import run_ranks
    cases = [(_copy(name, tmp_path / f"{i}"), stage) for i, (name, stage) in enumerate([
        ("net_fp16_zero2", 2), ("net_fp16_zero2", 3), ("net_fp16_zero2", 0),
        ("net_fp16_zero3", 3), ("net_fp16_zero3", 1), ("net_fp16_zero0", 0),
        ("net_fp16_zero0", 2)])]
    out = run_ranks(_fp16_cases, world_size=2, args=(cases,))
    assert out[0] == out[1]
    for (d, stage), got in zip(cases, out[0]):
        name = os.path.basename(d)
        want = _recorded(name)
        if name == "net_fp16_zero0":
            assert got["scales"][0] == want["loss_scales"][3] == 2.0 ** 18, (d, stage, got)
            assert got["losses"][0] == want["after"][0], (d, stage, got)
            assert _worst(got["losses"], want["after"]) <= ZERO0_BOUND, (d, stage, got)
            continue
        assert got["scales"] == want["loss_scales"][3:], (d, stage, got["scales"])
        assert got["skipped"] == [s - want["skipped_steps"][2]
                                  for s in want["skipped_steps"][3:]], (d, stage, got)
        assert _worst(got["losses"], want["after"]) <= TOLERANCE, (d, stage, got)


def test_an_fp16_import_holds_deepspeed_s_masters_moments_and_loss_scale():
    """The reader (no training): each fp16 fixture's fp32 masters and Adam moments are the
    files' exactly (the module's fp16 weights are their rounding, not read), and its loss
    scaler is hybrid's state for DeepSpeed's: the scale, the hysteresis left (ZeRO 2-3: 1,
    spent by the overflows at steps 0-1; without ZeRO 1, FP16_UnfusedOptimizer having
    none) and the clean-step count that puts hybrid's next doubling on DeepSpeed's step
    (``cur_iter - last_overflow_iter - 2``); each thing that does not map is a note."""
    from hybrid.checkpoint.peers import deepspeed as ds
    from hybrid.checkpoint.peers.deepspeed_files import load_file
    scalers = {"net_fp16_zero0": {"scale": 2.0 ** 18, "clean_steps": 2, "hysteresis_left": 1},
               "net_fp16_zero2": {"scale": 2.0 ** 17, "clean_steps": 0, "hysteresis_left": 1},
               "net_fp16_zero3": {"scale": 2.0 ** 17, "clean_steps": 0, "hysteresis_left": 1}}
    for name, scaler in scalers.items():
        tag = os.path.join(FIXTURES, name, "global_step3")
        ck = ds.open(os.path.join(FIXTURES, name))
        assert ck.loss_scaler == scaler, (name, ck.loss_scaler)
        assert any("DeepSpeed after one more" in n for n in ck.notes), ck.notes
        assert any("FP16_UnfusedOptimizer halves" in n for n in ck.notes) == name.endswith("0")
        want = (_deepspeed_bf16_stage0_values if name.endswith("0") else
                _deepspeed_full_values)(tag)
        for n, values in want.items():
            got = ck.read(n)
            assert all(torch.equal(got[k], v) for k, v in values.items()), (name, n)
        ck.close()
        if name != "net_fp16_zero3":  # (ZeRO 3's module files hold placeholders)
            module = load_file(os.path.join(tag, "mp_rank_00_model_states.pt"))["module"]
            for n, w in module.items():
                assert w.dtype == torch.float16, (name, n)
                assert torch.equal(want[n]["master"].half(), w), (name, n)
                # (ZeRO 2's masters have not moved: steps 0-1 skipped, step 2 at the
                # warm-up's rate 0; without ZeRO two steps moved them off fp16 values)
                assert torch.equal(want[n]["master"], w.float()) != name.endswith("0"), n


# At DP 1 hybrid's fp16 gradient is the whole batch's, DeepSpeed's each rank's half: whether
# a step overflows is the layout's. DeepSpeed's DP 2 run overflowed at step 4 (skipped);
# hybrid's DP 1 run does not, and from there its losses leave DeepSpeed's (measured 1.9e-2
# at worst); the two steps before agree within fp32 (1.2e-7).
OTHER_DP_BOUND = 2.5e-2


def test_one_rank_continues_an_fp16_checkpoint_until_the_layouts_overflow_apart(tmp_path):
    """ZeRO 2's fixture at 1 rank, ZeRO 2: the scale carried over (2**17 at step 3), the
    first two losses DeepSpeed's within 2e-6, then no skipped step where DeepSpeed's DP 2
    run skipped step 4, and the losses within :data:`OTHER_DP_BOUND`."""
    from hybrid.parallel.state import ParallelState
    d = _copy("net_fp16_zero2", tmp_path)
    got = _fp16_continue(ParallelState.single(), d, 2)
    want = _after("net_fp16_zero2")
    assert got["scales"][:2] == [2.0 ** 17] * 2 and got["skipped"] == [0] * 10, got
    assert max(abs(a - b) for a, b in zip(got["losses"][:2], want[:2])) <= TOLERANCE, got
    assert _worst(got["losses"], want) <= OTHER_DP_BOUND, got
