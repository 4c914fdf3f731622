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

import pytest
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


def _fp16_continue(ps, load_dir: str, stage: int, tag: str | None = None) -> dict:
    """A DeepSpeed user's fp16 script under hybrid at ZeRO ``stage``: the fixture's
    ds_config, load_checkpoint (of ``tag``: default ``latest``'s), 10 steps; the losses,
    the scale before each step and the skipped-step count after each."""
    from hybrid import deepspeed
    rec, f16 = _recorder(), _fp16()
    torch.manual_seed(123)  # other initial weights: the load must replace them all
    net = rec.Net()
    config = {**f16.fp16_config(rec.config(stage))}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=config, mpu=ps)
    assert net.fc1.weight.dtype == torch.float16
    engine.load_checkpoint(load_dir, tag=tag)
    assert (engine.global_steps, engine.global_samples) == (3, 24)
    out: dict = {"losses": [], "scales": [], "skipped": []}
    for step in range(rec.SAVED_AT, rec.SAVED_AT + rec.CONTINUED):
        out["scales"].append(float(engine.zero.scaler.scale))
        out["losses"].append(_fp16_step(engine, ps, step))
        out["skipped"].append(int(engine.skipped_steps))
    engine.close()
    return out


def _fp16_cases(ps, cases):
    return [_fp16_continue(ps, d, stage, "global_step3_universal" if i == 7 else None)
            for i, (d, stage) in enumerate(cases)]


# DeepSpeed 0.19.8 without ZeRO does not scale an fp16 loss (engine.backward scales it only
# for a ZeROOptimizer, and FP16_UnfusedOptimizer is not one) but FP16_UnfusedOptimizer still
# divides the gradients by its scale before Adam: net_fp16_zero0's DeepSpeed run steps on
# gradients 2**18 times too small (Adam's eps then weighs in) and never overflows. hybrid
# scales the loss, overflows at 2**18 (steps 3 and 4, halving to 2**16) and steps on the
# true gradients: its losses leave DeepSpeed's after the first (measured 1.4e-2 at worst).
ZERO0_BOUND = 2e-2


def test_deepspeed_fp16_checkpoints_continue_at_two_ranks(tmp_path):
    """Each fp16 fixture continued at DP 2 under hybrid's fp16 with its loss scale: at
    DeepSpeed's stage and at another (ZeRO 2's at 3 and 0, ZeRO 3's at 1, ZeRO 0's at 2;
    ZeRO 2's universal format, DeepSpeed's ds_to_universal of it, at 1), one launch.
    ZeRO 2-3: the 10 losses are DeepSpeed's within 2e-6 (measured: equal),
    each step's loss scale is DeepSpeed's, and the step DeepSpeed skipped (the overflow
    at step 4, which halves at once: the carried hysteresis is spent; a run starting
    afresh from 2**18 would skip steps 3 and 4) is skipped. ZeRO 0: the carried scale is
    DeepSpeed's, the first loss equal, the rest within :data:`ZERO0_BOUND` (above)."""
    from tests.helpers.harness import run_ranks
    cases = [(_copy(name, tmp_path / f"{i}"), stage) for i, (name, stage) in enumerate([
        ("net_fp16_zero2", 2), ("net_fp16_zero2", 3), ("net_fp16_zero2", 0),
        ("net_fp16_zero3", 3), ("net_fp16_zero3", 1), ("net_fp16_zero0", 0),
        ("net_fp16_zero0", 2), ("net_fp16_zero2", 1)])]
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
        if name == "net_fp16_zero2":  # (ds_to_universal keeps the scaler: the same)
            universal = ds.open(os.path.join(FIXTURES, name, "global_step3_universal"))
            assert universal.loss_scaler == scaler and universal.format.endswith("universal")
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


# -- the fp16 way back -------------------------------------------------------------------------
# hybrid trains the recorder's Net in fp16 (the fixtures' dynamic loss scaling) and its
# checkpoint is written as DeepSpeed's fp16 run saves, loss scaler included.

def _trained_fp16(ps, save: str, steps: int) -> dict:
    """Net under hybrid.deepspeed in fp16 at ZeRO 2: 10 steps, a save into ``save``,
    ``steps`` more; every step's global loss, and the scale each step ran at."""
    from hybrid import deepspeed as hds
    rec, f16 = _recorder(), _fp16()
    torch.manual_seed(0)
    net = rec.Net()
    engine, *_ = hds.initialize(model=net, model_parameters=net.parameters(),
                                config=f16.fp16_config(rec.config(2)), mpu=ps)
    out: dict = {"losses": [], "scales": [], "skipped": []}
    for step in range(10 + steps):
        if step == 10:
            engine.save_checkpoint(save)
        out["scales"].append(float(engine.zero.scaler.scale))
        out["losses"].append(_fp16_step(engine, ps, step))
        out["skipped"].append(int(engine.skipped_steps))
    engine.close()
    return out


def _deepspeed_fp16_rank(rank: int, port: int, cases: list, steps: int, out: str):
    """One DeepSpeed rank (fp16 under the recorder's CPU patch): for each ``(load_dir,
    ds_config)``, a fresh Net (another seed), ``load_checkpoint``, then ``steps`` of the
    recorder's batches; rank 0 saves each case's losses, scales and skips into ``out``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    rec, f16 = _recorder(), _fp16()
    f16.allow_fp16_on_cpu()
    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for load_dir, config in cases:
        torch.manual_seed(77)  # another start: the load must replace it
        net = rec.Net()
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                          config=config)
        path, _ = engine.load_checkpoint(load_dir)
        assert path is not None
        start, per = engine.global_steps, rec.GLOBAL_BATCH // 2
        got: dict = {"start": start, "losses": [], "scales": [], "skipped": [],
                     "optimizer": type(engine.optimizer).__name__,
                     "scaler": f16.scaler_state(engine)}
        for step in range(start, start + steps):
            x, y = rec.batch(step)
            rows = slice(rank * per, (rank + 1) * per)
            got["scales"].append(float(engine.optimizer.loss_scale))
            got["losses"].append(rec.step_mean(
                engine, f16.fp16_loss(rec.loss_of, engine, x[rows], y[rows]), 2))
            got["skipped"].append(int(engine.skipped_steps))
        results.append(got)
    if rank == 0:
        torch.save(results, out)
    rec.end_rank()


# DeepSpeed 0.19.8's ZeRO optimizers update the loss scale before they unscale the step's
# gradients (stage_1_and_2.py and stage3.py: _update_scale, then unscale_and_clip_grads by
# self.loss_scale): on the step where the scale doubles, DeepSpeed steps on half the true
# gradient; hybrid unscales by the scale the loss was scaled by. hybrid's run doubles after
# step 13 (the window of 9 clean steps since its overflow at step 4), and so does
# DeepSpeed's from the export (the scales agree), so the losses agree through step 13 and
# step 14's moves by that half step (measured 4.7e-4).
GROWTH_BOUND = 1e-3


@pytest.mark.peer("deepspeed")
def test_deepspeed_continues_hybrid_s_fp16_export(tmp_path):
    """hybrid.deepspeed trains Net in fp16 at DP 2 (ZeRO 2, dynamic loss scaling) for 10
    steps, saves, and trains 5 more; the checkpoint exported as DeepSpeed's fp16 run's at
    DP 2 -- ZeRO 1 (through ``convert_checkpoint.py export --to deepspeed --dtype fp16``),
    2 and 3 -- is loaded by DeepSpeed 0.19.8's engine.load_checkpoint under the same
    fp16 config (its CPU accelerator patched as the recorder's): the scale it holds is
    hybrid's, its next 5 scales (the doubling after step 13 included) and skipped steps
    are hybrid's, and its losses are hybrid's within 2e-6 through step 13 (measured:
    equal) and within :data:`GROWTH_BOUND` at step 14. Without ZeRO
    (FP16_UnfusedOptimizer's fields) DeepSpeed loads hybrid's scale too; its losses are
    not compared (it does not scale the loss: ZERO0_BOUND's note)."""
    from hybrid.checkpoint.peers import deepspeed as ds
    from tests.helpers.harness import run_ranks
    from tests.helpers.launch import free_port, run_script
    rec, f16, steps, save = _recorder(), _fp16(), 5, str(tmp_path / "hybrid")
    ours = run_ranks(_trained_fp16, world_size=2, args=(save, steps))[0]
    cases = []
    for stage in (1, 2, 3, 0):
        out, config = str(tmp_path / f"zero{stage}"), f16.fp16_config(rec.config(stage))
        if stage == 1:
            r = run_script("convert_checkpoint", ["export", "--to", "deepspeed", save, out,
                                                  "--dp-size", "2", "--zero-stage", "1",
                                                  "--dtype", "fp16"])
            assert r.returncode == 0 and "ZeRO 1 fp16 checkpoint" in r.stdout, r.stderr
        else:  # (the checkpoint's own dtype: fp16)
            ds.write(save, out, 2, stage)
        cases.append((out, config))
    got = str(tmp_path / "theirs.pt")
    torch.multiprocessing.spawn(_deepspeed_fp16_rank, nprocs=2,
                                args=(free_port(), cases, steps, got))
    theirs = torch.load(got, weights_only=True)
    kinds = ["DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3",
             "FP16_UnfusedOptimizer"]
    for (out, _), kind, result in zip(cases, kinds, theirs):
        assert result["optimizer"] == kind and result["start"] == 10, (out, result)
        assert result["scales"][0] == ours["scales"][10], (out, result, ours["scales"])
        if kind == "FP16_UnfusedOptimizer":
            continue
        assert result["scales"] == ours["scales"][10:], (out, result, ours["scales"])
        skipped = [s - ours["skipped"][9] for s in ours["skipped"][10:]]
        assert result["skipped"] == skipped, (out, result["skipped"], skipped)
        diff = [abs(a - b) for a, b in zip(result["losses"], ours["losses"][10:])]
        assert max(diff[:4]) <= TOLERANCE and diff[4] <= GROWTH_BOUND, (out, diff)
        assert diff[4] > TOLERANCE, (out, diff)  # (DeepSpeed's halved step, as said above)


def test_an_fp16_import_exports_as_deepspeed_s_own_fp16_files(tmp_path):
    """Without DeepSpeed: each fp16 fixture imported (its masters, moments, step and loss
    scale as a hybrid checkpoint) and exported back under its own ds_config, at its own
    DP size and stage, is DeepSpeed's save again where it matters: the same files and
    keys, the module's fp16 weights and the fp32 masters and moments bit for bit, and the
    loss scaler DeepSpeed pickled (ZeRO 2-3: every DynamicLossScaler field, the counters
    included) or FP16_UnfusedOptimizer's loss-scale fields (no ZeRO)."""
    from hybrid.checkpoint.peers import deepspeed as ds
    from hybrid.checkpoint.peers.deepspeed_files import load_file
    from hybrid.checkpoint.peers.importing import import_peer
    for name in ("net_fp16_zero0", "net_fp16_zero2", "net_fp16_zero3"):
        theirs = os.path.join(FIXTURES, name, "global_step3")
        peer = ds.open(os.path.join(FIXTURES, name), names="module")
        stage, config = peer.stage, peer.model_state["ds_config"]
        src = import_peer(peer, str(tmp_path / name / "hybrid"), {}, None)
        peer.close()
        tag = ds.write(src, str(tmp_path / name / "out"), 2, stage, ds_config=config,
                       param_groups="one")  # (DeepSpeed's run: model.parameters())
        assert sorted(os.listdir(tag)) == sorted(os.listdir(theirs)), name
        for f in os.listdir(tag):
            mine, want = load_file(os.path.join(tag, f)), load_file(os.path.join(theirs, f))
            client = {"universal_checkpoint_info"}  # (the recorder's client state: not written)
            assert sorted(mine) == sorted(set(want) - client), (name, f)
            for k, v in want.get("module", {}).items():
                assert v.dtype == torch.float16 and torch.equal(mine["module"][k], v), (f, k)
            if stage == 0:  # (FP16_UnfusedOptimizer's fields, the masters per parameter)
                keys = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter",
                        "scale_factor", "scale_window")
                assert ({k: mine["optimizer"][k] for k in keys}
                        == {k: want["optimizer"][k] for k in keys}), name
                assert all(torch.equal(a, b) for a, b in zip(
                    mine["optimizer"]["fp32_groups"][0], want["optimizer"]["fp32_groups"][0]))
            if "optimizer_state_dict" in want:
                a, b = (x["optimizer_state_dict"] for x in (mine, want))
                assert type(a["loss_scaler"]).__name__ == "DynamicLossScaler", (name, f)
                assert a["loss_scaler"].__dict__ == b["loss_scaler"].__dict__, (name, f)
                assert a["dynamic_loss_scale"] is b["dynamic_loss_scale"] is True
        back, orig = ds.open(tag), ds.open(os.path.join(FIXTURES, name))
        assert back.loss_scaler == orig.loss_scaler, name  # (DeepSpeed's padding: not
        for n in orig.shapes:  # compared, it holds whatever was in memory there)
            assert all(torch.equal(back.read(n)[k], v) for k, v in orig.read(n).items()), n
        back.close()
        orig.close()


def _edit(path: str, edit) -> None:
    """Rewrite DeepSpeed file ``path`` after ``edit(state)`` (its DeepSpeed objects kept
    under DeepSpeed's names: the export's pickler)."""
    from hybrid.checkpoint.peers.deepspeed_export import _save
    from hybrid.checkpoint.peers.deepspeed_files import load_file
    state = load_file(path)
    edit(state)
    _save(state, path + ".new")
    os.replace(path + ".new", path)


def test_an_fp16_file_without_its_loss_scale_is_one_error_naming_it(tmp_path):
    """An fp16 save whose loss scaler lost its scale (ZeRO 2's pickled scaler) or its
    counters (FP16_UnfusedOptimizer's ``cur_iter``): one CheckpointError naming the file."""
    from hybrid.checkpoint.peers import deepspeed as ds
    from hybrid.errors import CheckpointError
    d = _copy("net_fp16_zero2", tmp_path)
    path = os.path.join(d, "global_step3", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _edit(path, lambda sd: sd["optimizer_state_dict"]["loss_scaler"].__dict__.pop("cur_scale"))
    ck = ds.open(d)
    with pytest.raises(CheckpointError, match=rf"^{path}: an fp16 run's file without its "
                                              rf"loss scale \(cur_scale None\)$"):
        ck.loss_scaler  # noqa: B018
    d = _copy("net_fp16_zero0", tmp_path)
    path = os.path.join(d, "global_step3", "mp_rank_00_model_states.pt")
    _edit(path, lambda sd: sd["optimizer"].pop("cur_iter"))
    with pytest.raises(CheckpointError, match=rf"^{path}: an fp16 run's dynamic loss scale "
                                              rf"without its counters \(cur_iter None"):
        ds.open(d)
