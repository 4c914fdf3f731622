"""DeepSpeed 0.19.8 checkpoints into hybrid, and hybrid's back into DeepSpeed.

The fixtures under tests/fixtures/peers/deepspeed-0.19.8/ were written by DeepSpeed itself
(benchmarks/peers/record_deepspeed_checkpoint.py: 2 ranks, ZeRO 2 and ZeRO 3, 3 steps of
:class:`Net`, then 10 more whose losses are in ``losses.json``). A script that calls
``engine.load_checkpoint(dir)`` under ``import hybrid.deepspeed as deepspeed`` continues
them: its next 10 losses equal DeepSpeed's within 2e-6, at DeepSpeed's layout (2 ranks,
the same stage) and at others (1 rank; stage 1 from a stage-2 save, stage 3 from 2,
stage 2 from 3). The masters and moments hybrid imported equal the ones in DeepSpeed's
files, read here with torch.load and a few lines of arithmetic rather than the reader.
Bad input is one CheckpointError naming the file, with nothing imported.

The bf16 fixtures (``net_bf16_zero0..3``: DeepSpeed's bf16 without ZeRO, BF16_Optimizer,
ZeRO 2 and 3) continue under hybrid's bf16 at DP 2 with DeepSpeed's losses bit for bit,
at 1 rank within bf16's rounding of the gradients at another point; their masters and
moments come over exactly (the tests at the end). hybrid's own bf16 run goes back as
DeepSpeed's bf16 files (ZeRO 1, BF16_Optimizer, ZeRO 2 and 3), which DeepSpeed continues
bit for bit at DP 2 holding hybrid's masters and moments exactly (the last tests).

Only the way back (:func:`test_deepspeed_continues_from_hybrid_s_export`) needs DeepSpeed.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import math
import os
import shutil

import pytest
import torch

from hybrid.checkpoint import iter_full_params
from hybrid.errors import CheckpointError
from tests.helpers.deepspeed_pickles import PICKLE as _PICKLE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "peers", "deepspeed-0.19.8")
TOLERANCE = 2e-6


def _recorder():
    """benchmarks/peers/record_deepspeed_checkpoint.py: the model, config and batches
    DeepSpeed trained with."""
    path = os.path.join(ROOT, "benchmarks", "peers", "record_deepspeed_checkpoint.py")
    spec = importlib.util.spec_from_file_location("record_deepspeed_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy(name: str, dst) -> str:
    out = os.path.join(str(dst), name)
    shutil.copytree(os.path.join(FIXTURES, name), out)
    return out


def _tree_digest(path: str) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _continue(ps, load_dir: str, stage: int, frozen: dict | None = None) -> list[float]:
    """A DeepSpeed user's script under hybrid: build, load_checkpoint, train 10 steps;
    the global batch's loss of each (the mean over the DP ranks' micro-batches).
    ``frozen``: a dict to receive the recorder's FrozenNet's frozen weights and buffers
    after the load (the model is that one then)."""
    from hybrid import deepspeed
    rec = _recorder()
    torch.manual_seed(123)  # other initial weights: the load must replace them all
    net = rec.FrozenNet() if frozen is not None else rec.Net()
    engine, *_ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=rec.config(stage), mpu=ps)
    path, client = engine.load_checkpoint(load_dir)
    assert path.endswith(os.path.join("hybrid_import", "iter_0000003")), path
    assert (engine.global_steps, engine.global_samples) == (3, 24)
    assert engine.lr_scheduler.state_dict() == {"last_batch_iteration": 2}
    if frozen is not None:
        frozen.update({k: v.clone() for k, v in net.state_dict().items()
                       if not k.startswith("head.")})
    losses = [_step(engine, ps, step) for step in range(rec.SAVED_AT,
                                                         rec.SAVED_AT + rec.CONTINUED)]
    engine.close()
    return losses


def _step(engine, ps, step: int, bf16: bool = False) -> float:
    """One step of the recorder's batch ``step`` on this DP rank's rows (DeepSpeed's
    engine or hybrid's; ``bf16``: the recorder's bf16 run's loss): the global loss (the
    mean over the DP ranks' micro-batches)."""
    rec = _recorder()
    per, rank, world = rec.GLOBAL_BATCH // ps.dp_size, ps.dp_rank, ps.dp_size
    x, y = rec.batch(step)
    rows = slice(rank * per, (rank + 1) * per)
    loss = rec.bf16_loss(engine, x[rows], y[rows]) if bf16 else \
        rec.loss_of(engine(x[rows]), y[rows])
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone().reshape(1)
    if world > 1:
        ps.world_group.all_reduce(mean)
    return float(mean) / world


def _two_ranks(ps, cases):
    return [_continue(ps, d, stage) for d, stage in cases]


def _worst(got, want) -> float:
    assert len(got) == len(want) == 10
    return max(abs(a - b) for a, b in zip(got, want))


def _after(name: str) -> list[float]:
    with open(os.path.join(FIXTURES, name, "losses.json")) as f:
        return json.load(f)["after"]


def test_a_deepspeed_checkpoint_continues_exactly_at_two_ranks(tmp_path):
    """DeepSpeed's layout (DP 2, its stage) and another stage (ZeRO 0's at ZeRO 2), in one
    2-rank launch;
    DeepSpeed's files and its ``latest`` are left as they were."""
    from tests.helpers.harness import run_ranks
    cases = [(_copy("net_zero2", tmp_path / "a"), 2), (_copy("net_zero3", tmp_path / "b"), 3),
             (_copy("net_zero2", tmp_path / "c"), 3), (_copy("net_zero3", tmp_path / "d"), 2),
             (_copy("net_zero0", tmp_path / "e"), 2)]
    before = {d: _tree_digest(os.path.join(d, "global_step3")) for d, _ in cases}
    out = run_ranks(_two_ranks, world_size=2, args=(cases,))
    assert out[0] == out[1]
    for (d, stage), got in zip(cases, out[0]):
        want = _after(os.path.basename(d))
        assert _worst(got, want) <= TOLERANCE, (d, stage, got, want)
        assert _tree_digest(os.path.join(d, "global_step3")) == before[d]
        with open(os.path.join(d, "latest")) as f:
            assert f.read().strip() == "global_step3"




def _frozen_cases(ps, cases):
    out = []
    for d, stage in cases:
        got: dict = {}
        out.append((_continue(ps, d, stage, got), got))
    return out


def test_frozen_parameters_and_buffers_come_over_and_the_run_continues(tmp_path):
    """DeepSpeed's FrozenNet (a frozen layer, in no ZeRO partition, and a BatchNorm's
    running statistics) at ZeRO 2 and 3, continued at DP 2 at its stage and at ZeRO 1
    from ZeRO 3's partitioned fragments; without ZeRO (the optimizer's numbered state
    holds the trained parameters only: the loading module's frozen ones are left out of
    its order) at stage 0 and at ZeRO 3: the 10 losses within 2e-6 of DeepSpeed's; the
    frozen weight is the one DeepSpeed started from (the script's own, drawn from
    another seed, is replaced), the statistics DeepSpeed's rank 0 saved."""
    from tests.helpers.harness import run_ranks
    rec = _recorder()
    torch.manual_seed(0)
    start = rec.FrozenNet()  # DeepSpeed's initial model: its frozen layer never moved
    cases = [(_copy("frozen_zero2", tmp_path / "a"), 2), (_copy("frozen_zero3", tmp_path / "b"), 3),
             (_copy("frozen_zero3", tmp_path / "c"), 1), (_copy("frozen_zero0", tmp_path / "d"), 0),
             (_copy("frozen_zero0", tmp_path / "e"), 3)]
    out = run_ranks(_frozen_cases, world_size=2, args=(cases,))
    for (d, stage), (losses, got) in zip(cases, out[0]):
        want = _after(os.path.basename(d))
        assert _worst(losses, want) <= TOLERANCE, (d, stage, losses, want)
        ms = torch.load(os.path.join(d, "global_step3", "mp_rank_00_model_states.pt"
                                     if "zero3" not in d else
                                     "zero_pp_rank_0_mp_rank_00_model_states.pt"),
                        weights_only=False, pickle_module=_PICKLE)["module"]
        assert sorted(got) == ["base.bias", "base.weight", "norm.num_batches_tracked",
                               "norm.running_mean", "norm.running_var"]
        for name in ("base.weight", "base.bias"):
            assert torch.equal(got[name], start.state_dict()[name]), (d, name)
        for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
            assert torch.equal(got[name], ms[name]), (d, name)
        assert int(got["norm.num_batches_tracked"]) == 3
        assert out[1][0][1].keys() == got.keys()  # (every rank took them)


def _continue_excluded(ps, load_dir: str) -> tuple[list[float], bool]:
    """A PEFT-style script: the frozen base rebuilt as the script builds it (the recorder's
    seed), the trained head scaled so that the load must replace it; load DeepSpeed's
    save made with ``exclude_frozen_parameters``, train 10 steps: (the losses, whether
    the frozen base is the script's own still)."""
    from hybrid import deepspeed
    rec = _recorder()
    torch.manual_seed(0)
    net = rec.FrozenNet()
    base = net.base.weight.detach().clone()
    with torch.no_grad():
        for p in net.head.parameters():
            p.mul_(3)
    engine, *_ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=rec.config(2), mpu=ps)
    engine.load_checkpoint(load_dir)
    losses = [_step(engine, ps, step) for step in range(rec.SAVED_AT,
                                                         rec.SAVED_AT + rec.CONTINUED)]
    engine.close()
    return losses, torch.equal(net.base.weight, base)


def test_a_save_without_its_frozen_parameters_continues_on_the_module_s_own(tmp_path):
    """DeepSpeed's ``save_checkpoint(exclude_frozen_parameters=True)`` (what Hugging Face's
    Trainer saves for a PEFT model: no frozen values, no frozen shapes): a script whose
    module freezes those parameters loads it, keeps its own frozen base (one line says
    so), takes the rest and the buffers, and continues DeepSpeed's 10 losses within 2e-6
    at DP 2; the same save into a module that freezes nothing is another model's."""
    from hybrid import deepspeed
    from hybrid.parallel.state import ParallelState
    from tests.helpers.harness import run_ranks
    d = _copy("frozen_zero2_excluded", tmp_path)
    losses, kept = run_ranks(_continue_excluded, world_size=2, args=(d,))[0]
    assert kept
    want = _after("frozen_zero2_excluded")
    assert _worst(losses, want) <= TOLERANCE, (losses, want)
    meta = json.loads((tmp_path / "frozen_zero2_excluded" / "hybrid_import" / "iter_0000003" /
                       "metadata.json").read_text())
    assert meta["module_state_excludes_frozen"] and meta["frozen_parameters"] == [
        "base.weight", "base.bias"]
    rec = _recorder()
    net = rec.FrozenNet()
    net.base.requires_grad_(True)  # (trains everything: the base is missing from the save)
    engine = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                  config=rec.config(2), mpu=ParallelState.single())[0]
    with pytest.raises(CheckpointError, match=r"a checkpoint of another model: it has \[\] "
                                              r"this engine's module lacks, lacks \['base"):
        engine.load_checkpoint(_copy("frozen_zero2_excluded", tmp_path / "b"))


def _deepspeed_full_values(tag_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's master and moments, gathered from DeepSpeed's optimizer files as
    zero_to_fp32 documents the layout (each rank's flat partition end to end at stages
    1-2; each parameter split over the ranks at stage 3)."""
    files = sorted(f for f in os.listdir(tag_dir) if f.endswith("optim_states.pt"))
    states = [torch.load(os.path.join(tag_dir, f), weights_only=False,
                         pickle_module=_PICKLE)["optimizer_state_dict"] for f in files]
    model = next(f for f in os.listdir(tag_dir) if f.endswith("model_states.pt"))
    shapes = torch.load(os.path.join(tag_dir, model), weights_only=False,
                        pickle_module=_PICKLE)["param_shapes"][0]
    out: dict[str, dict[str, torch.Tensor]] = {n: {} for n in shapes}
    if "single_partition_of_fp32_groups" in states[0]:
        flat = {"master": torch.cat([s["single_partition_of_fp32_groups"][0] for s in states])}
        for k in ("exp_avg", "exp_avg_sq"):
            flat[k] = torch.cat([s["base_optimizer_state"]["state"][0][k] for s in states])
        at = 0
        for n, shape in shapes.items():
            for k, v in flat.items():
                out[n][k] = v[at:at + math.prod(shape)].view(shape)
            at += math.prod(shape)
    else:
        flats = [{"master": s["fp32_flat_groups"][0],
                  **{k: s["optimizer_state_dict"]["state"][0][k] for k in ("exp_avg",
                                                                          "exp_avg_sq")}}
                 for s in states]
        at = 0
        for n, shape in shapes.items():
            q = -(-math.prod(shape) // len(states))
            for k in flats[0]:
                whole = torch.cat([f[k][at:at + q] for f in flats])
                out[n][k] = whole[:math.prod(shape)].view(shape)
            at += q
    return out


def _deepspeed_stage0_values(tag_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """Stage 0's: the module's weights, and the torch optimizer's state of the i-th
    parameter for the module's i-th (the net has no buffers, no tied weights)."""
    ms = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), weights_only=False,
                    pickle_module=_PICKLE)
    state = ms["optimizer"]["state"]
    return {n: {"master": w, **{k: state[i][k] for k in ("exp_avg", "exp_avg_sq")}}
            for i, (n, w) in enumerate(ms["module"].items())}


def _one_rank_continues(load_dir: str, stage: int) -> list[float]:
    from hybrid.parallel.state import ParallelState
    return _continue(ParallelState.single(), load_dir, stage)


@pytest.mark.parametrize("fixture,stage", [("net_zero2", 1), ("net_zero3", 3),
                                           ("net_zero0", 3)])
def test_one_rank_continues_and_imports_deepspeed_s_values(tmp_path, fixture, stage):
    """At 1 rank (another DP size, and another stage from DeepSpeed's): the same 10
    losses; the imported masters, moments and step are DeepSpeed's; a second load (a
    restart) reads the import and none of DeepSpeed's optimizer files (emptied, it still
    loads)."""
    d = _copy(fixture, tmp_path)
    got = _one_rank_continues(d, stage)
    assert _worst(got, _after(fixture)) <= TOLERANCE, got
    want = (_deepspeed_stage0_values if fixture == "net_zero0" else _deepspeed_full_values)(
        os.path.join(d, "global_step3"))
    meta, params = iter_full_params(os.path.join(d, "hybrid_import", "iter_0000003"))
    seen = dict(params)
    assert sorted(seen) == sorted(want)
    for n, values in want.items():
        for k, v in values.items():
            assert torch.equal(seen[n][k], v), (n, k)
    assert (meta["step"], meta["iteration"], meta["consumed_samples"]) == (3, 3, 24)
    assert meta["imported_from"]["format"] == f"DeepSpeed ZeRO {fixture[-1]}"
    for f in os.listdir(os.path.join(d, "global_step3")):
        if f.endswith("optim_states.pt"):  # emptied: a read of one would fail
            open(os.path.join(d, "global_step3", f), "w").close()
    assert _one_rank_continues(d, stage) == got


def test_deepspeed_s_universal_checkpoint_continues_the_same(tmp_path):
    """ds_to_universal's conversion of the ZeRO 2 save (``global_step3_universal/``, one
    file per parameter and value): load_checkpoint with its tag continues with
    DeepSpeed's losses, its values those of the ZeRO files."""
    from hybrid import deepspeed
    from hybrid.checkpoint.peers import deepspeed as ds
    from hybrid.parallel.state import ParallelState
    rec = _recorder()
    d = _copy("net_zero2", tmp_path)
    universal, zero = ds.open(os.path.join(d, "global_step3_universal")), ds.open(d)
    assert (universal.format, universal.step, universal.iteration) == (
        "DeepSpeed universal", 3, 3)
    for n in zero.shapes:
        a, b = zero.read(n), universal.read(n)
        assert all(torch.equal(a[k], b[k]) for k in a), n
    torch.manual_seed(9)
    net = rec.Net()
    engine = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                  config=rec.config(3), mpu=ParallelState.single())[0]
    engine.load_checkpoint(d, tag="global_step3_universal")
    assert (engine.global_steps, engine.lr_scheduler.state_dict()) == (
        3, {"last_batch_iteration": 2})
    losses = []
    for step in range(rec.SAVED_AT, rec.SAVED_AT + rec.CONTINUED):
        x, y = rec.batch(step)
        loss = rec.loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert _worst(losses, _after("net_zero2")) <= TOLERANCE, losses


def test_bad_deepspeed_checkpoints_are_one_error_naming_the_file(tmp_path):
    """A truncated optimizer file, a missing rank's file (or all of them), ZeRO 0's
    optimizer in another order than the module's parameters, a model of another shape:
    one CheckpointError each, naming the file; nothing imported."""
    from hybrid import deepspeed
    from hybrid.parallel.state import ParallelState
    rec = _recorder()

    def engine_of(net):
        return deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                    config=rec.config(2), mpu=ParallelState.single())[0]

    d = _copy("net_zero2", tmp_path / "truncated")
    victim = os.path.join(d, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(CheckpointError, match=rf"^{victim}: not a readable DeepSpeed "
                                              rf"checkpoint file \(truncated"):
        engine_of(rec.Net()).load_checkpoint(d)
    # nothing published (an unfinished .tmp_iter_* is what the next attempt replaces)
    assert not [n for n in os.listdir(os.path.join(d, "hybrid_import")) if n[0] != "."]

    d = _copy("net_zero3", tmp_path / "missing")
    os.remove(os.path.join(d, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(CheckpointError, match=r"global_step3: DeepSpeed dp_world_size 2 .*"
                                              r"zero_pp_rank_0\.\.1_mp_rank_00_optim_states"):
        engine_of(rec.Net()).load_checkpoint(d)

    d = _copy("net_zero2", tmp_path / "nooptim")  # every optimizer file gone
    for f in glob.glob(os.path.join(d, "global_step3", "*optim_states.pt")):
        os.remove(f)
    with pytest.raises(CheckpointError, match=r"global_step3: a DeepSpeed ZeRO 2 checkpoint "
                                              r"without its zero_pp_rank_\*"):
        engine_of(rec.Net()).load_checkpoint(d)

    # ZeRO 0 names no optimizer state: an optimizer whose groups reorder the module's
    # parameters (weights, then biases: DeepSpeed's examples' weight-decay split) is
    # refused by shape, not read into the wrong parameters
    d = _copy("net_zero0", tmp_path / "regrouped")
    path = os.path.join(d, "global_step3", "mp_rank_00_model_states.pt")
    ms = torch.load(path, weights_only=True)
    st, group = ms["optimizer"]["state"], ms["optimizer"]["param_groups"][0]
    ms["optimizer"] = {"state": {0: st[0], 1: st[2], 2: st[1], 3: st[3]},
                       "param_groups": [{**group, "params": [0, 1]},
                                        {**group, "params": [2, 3]}]}
    torch.save(ms, path)
    with pytest.raises(CheckpointError, match=rf"^{path}: the optimizer's parameter 1 holds "
                                              rf"\[5, 9\], the module's fc1\.bias is \[9\]"):
        engine_of(rec.Net()).load_checkpoint(d)
    assert not os.path.exists(os.path.join(d, "hybrid_import"))

    d = _copy("gpt2_zero2", tmp_path / "noconfig")  # a GPT-2's heads are in config.json
    os.remove(os.path.join(d, "config.json"))
    from hybrid.checkpoint.peers import deepspeed as ds
    with pytest.raises(CheckpointError, match=rf"^{d}/global_step3: a transformers "
                                              rf"GPT2LMHeadModel's DeepSpeed checkpoint; "
                                              rf"hybrid needs the model's config.json"):
        ds.open(d)

    d = _copy("net_zero2", tmp_path / "shape")
    other = torch.nn.Sequential()
    other.fc1, other.fc2 = torch.nn.Linear(7, 9), torch.nn.Linear(9, 6)
    with pytest.raises(CheckpointError, match=rf"^{d}/global_step3/mp_rank_00_model_states"
                                              rf"\.pt: a checkpoint of another model: "
                                              rf"fc2\.weight is \[5, 9\] there and \[6, 9\]"):
        engine_of(other).load_checkpoint(d)
    assert not os.path.exists(os.path.join(d, "hybrid_import"))  # refused before any write


def test_an_export_reads_back_as_the_hybrid_checkpoint_it_came_from(tmp_path, monkeypatch):
    """The way back without DeepSpeed: hybrid's checkpoint written as DeepSpeed's at
    several DP sizes and stages reads back (through the DeepSpeed reader, which checks
    DeepSpeed's own slice records) to the same masters, moments, step and counters.
    The export reads each parameter of the checkpoint twice (the optimizer's partitions,
    then the module) whatever the DP size, hands torch.save the module's weights and the
    moments as mapped files (memory holds about one parameter), and leaves no scratch
    files."""
    from hybrid.checkpoint.peers import deepspeed as ds, deepspeed_export
    d = _copy("net_zero3", tmp_path)
    _one_rank_continues(d, 2)
    src = os.path.join(d, "hybrid_import", "iter_0000003")
    _, params = iter_full_params(src)
    want = dict(params)
    reads: list[str] = []

    def counting(ckpt, keys=None):
        meta, params = iter_full_params(ckpt, keys)
        return meta, ((reads.append(n), (n, v))[1] for n, v in params)
    monkeypatch.setattr(deepspeed_export, "iter_full_params", counting)
    in_memory: list[str] = []  # module weights and moments torch.save got not file-backed
    real_save = deepspeed_export._save

    def save(obj, path):
        osd = obj.get("optimizer_state_dict") or {}
        base = osd.get("base_optimizer_state") or osd.get("optimizer_state_dict") or {}
        tensors = {**obj.get("module", {}),
                   **{f"{g}.{k}": v for g, st in base.get("state", {}).items()
                      for k, v in st.items() if k != "step"}}
        in_memory.extend(k for k, v in tensors.items()
                         if v.numel() and v.untyped_storage().filename is None)
        real_save(obj, path)
    monkeypatch.setattr(deepspeed_export, "_save", save)
    for stage, dp in ((1, 3), (2, 2), (3, 2), (3, 4)):
        out = str(tmp_path / f"out{stage}{dp}")
        reads.clear()
        assert ds.write(src, out, dp, stage) == os.path.join(out, "global_step3")
        passes = 2 if stage < 3 else 1  # (stage 3's module files hold placeholders)
        assert sorted(reads) == sorted(passes * list(want)), (stage, dp, reads)
        assert in_memory == [], (stage, dp, in_memory)  # (mapped scratch files)
        assert sorted(os.listdir(os.path.join(out, "global_step3"))) == sorted(
            [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp)]
            + (["mp_rank_00_model_states.pt"] if stage < 3 else
               [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(dp)]))
        back = ds.open(out)
        assert (back.stage, back.world, back.step, back.iteration, back.consumed_samples) == (
            stage, dp, 3, 3, 24)
        for n, values in want.items():
            got = back.read(n)
            assert all(torch.equal(got[k], v) for k, v in values.items()), (stage, dp, n)
        back.close()
    with pytest.raises(CheckpointError, match="global_step3: already exists"):
        ds.write(src, str(tmp_path / "out22"), 2, 2)
    # Hugging Face's Trainer's groups: the matrices with the run's weight decay, then the
    # biases without, each group flat and padded on its own
    _groups_read_back(src, str(tmp_path / "groups"), want, "matrices",
                      [["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"]])


def _groups_read_back(src: str, out: str, want: dict, param_groups: str | None,
                      groups: list[list[str]]) -> None:
    """``src`` exported at DP 2, ZeRO 2 and 3, reads back with ``groups`` (names, in
    order), weight decay 0.01 then 0.0, and ``want``'s values."""
    from hybrid.checkpoint.peers import deepspeed as ds
    for stage in (2, 3):
        ds.write(src, f"{out}{stage}", 2, stage, param_groups=param_groups)
        back = ds.open(f"{out}{stage}")
        assert [list(g) for g in back._groups] == groups
        for rank in (0, 1):
            decay = [g["weight_decay"] for g in back._base_state(rank)["param_groups"]]
            assert decay == [0.01, 0.0], (stage, rank, decay)
        for n, values in want.items():
            got = back.read(n)
            assert all(torch.equal(got[k], v) for k, v in values.items()), (stage, n)
        back.close()


def _groups(net) -> list[dict]:
    """A script's own optimizer groups: weight decay on the weights (fc2's first), none on
    the biases -- an order that is not the module's."""
    return [{"params": [net.fc2.weight, net.fc1.weight], "weight_decay": 0.01},
            {"params": [net.fc1.bias, net.fc2.bias], "weight_decay": 0.0}]


def _trained_with_groups(tmp_path, steps: int) -> tuple[str, list[float]]:
    """A hybrid.deepspeed engine over :func:`_groups`, 10 steps then a save, then
    ``steps`` more: (the checkpoint, every loss)."""
    from hybrid import deepspeed as hds
    from hybrid.parallel.state import ParallelState
    rec = _recorder()
    torch.manual_seed(0)
    net = rec.Net()
    engine, *_ = hds.initialize(model=net, model_parameters=_groups(net),
                                config=rec.config(2), mpu=ParallelState.single())
    losses, saved = [], None
    for step in range(10 + steps):
        if step == 10:
            saved = engine.save_checkpoint(str(tmp_path / "hybrid"))
        x, y = rec.batch(step)
        loss = rec.loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    saved = saved or engine.save_checkpoint(str(tmp_path / "hybrid"))
    engine.close()
    return saved, losses


def test_a_script_s_optimizer_groups_go_back_as_deepspeed_s(tmp_path):
    """A hybrid.deepspeed engine built over the script's own groups records them by name;
    the export writes DeepSpeed's groups as the script built them (its order, its weight
    decay), and the values read back."""
    saved, _ = _trained_with_groups(tmp_path, 0)
    _, params = iter_full_params(saved)
    _groups_read_back(saved, str(tmp_path / "ds"), dict(params), None,
                      [["fc2.weight", "fc1.weight"], ["fc1.bias", "fc2.bias"]])


def _deepspeed_rank(rank: int, port: int, load_dir: str, stage: int, steps: int, out: str,
                    frozen: bool = False):
    """One DeepSpeed rank: load ``load_dir``, train ``steps`` of the recorder's batches
    from the checkpoint's step; rank 0 writes the global losses to ``out``. ``frozen``:
    the recorder's FrozenNet over its trained parameters (else Net over :func:`_groups`)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rec = _recorder()
    torch.manual_seed(77)  # another start: the load must replace it, frozen layer too
    net = rec.FrozenNet() if frozen else rec.Net()
    params = ([p for p in net.parameters() if p.requires_grad] if frozen else _groups(net))
    engine, *_ = deepspeed.initialize(model=net, model_parameters=params,
                                      config=rec.config(stage))
    path, _ = engine.load_checkpoint(load_dir)
    assert path is not None
    start, per = engine.global_steps, rec.GLOBAL_BATCH // 2
    losses = []
    for step in range(start, start + steps):
        x, y = rec.batch(step)
        loss = rec.loss_of(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        losses.append(rec.step_mean(engine, loss, 2))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"start": start, "losses": losses,
                       "samples": engine.global_samples}, f)
    rec.end_rank()


@pytest.mark.peer("deepspeed")
def test_deepspeed_continues_from_hybrid_s_export(tmp_path):
    """A hybrid.deepspeed script (its own two optimizer groups, out of the module's order)
    trains 10 steps and saves; its checkpoint exported as DeepSpeed's (2 ranks, without
    ZeRO -- the torch optimizer's state dict in the model-state file --, ZeRO 2 and ZeRO 3)
    is loaded by DeepSpeed 0.19.8's own engine.load_checkpoint under the same script's
    groups, whose next 5 losses equal hybrid's next 5 within 2e-6."""
    from hybrid.checkpoint.peers import deepspeed as ds
    from tests.helpers.launch import free_port
    rec, steps = _recorder(), 5
    saved, losses = _trained_with_groups(tmp_path, steps)
    for stage in (0, 2, 3):
        out = str(tmp_path / f"ds{stage}")
        ds.write(saved, out, 2, stage)
        got = str(tmp_path / f"losses{stage}.json")
        torch.multiprocessing.spawn(_deepspeed_rank, nprocs=2,
                                    args=(free_port(), out, stage, steps, got))
        with open(got) as f:
            theirs = json.load(f)
        assert theirs["start"] == 10 and theirs["samples"] == (10 + steps) * rec.GLOBAL_BATCH
        worst = max(abs(a - b) for a, b in zip(theirs["losses"], losses[10:]))
        assert len(theirs["losses"]) == steps and worst <= TOLERANCE, (stage, theirs, losses)


def _trained_frozen(ps, save: str, steps: int) -> list[float]:
    """The recorder's FrozenNet under hybrid.deepspeed at DP 2 (each rank's BatchNorm on
    its own rows, as DeepSpeed's), 10 steps then a save into ``save``, then ``steps``
    more: every step's global loss."""
    from hybrid import deepspeed as hds
    rec = _recorder()
    torch.manual_seed(0)
    net = rec.FrozenNet()
    engine, *_ = hds.initialize(model=net,
                                model_parameters=[p for p in net.parameters() if p.requires_grad],
                                config=rec.config(2), mpu=ps)
    losses = []
    for step in range(10 + steps):
        if step == 10:
            engine.save_checkpoint(save)
        losses.append(_step(engine, ps, step))
    engine.close()
    return losses


@pytest.mark.parametrize("exclude", [False, True])
def test_a_frozen_module_s_export_reads_back(tmp_path, exclude):
    """A hybrid.deepspeed FrozenNet's checkpoint exported at DP 2, ZeRO 2 and 3, read back
    by hybrid's DeepSpeed reader: the frozen layer (whole at ZeRO 2, from both ranks'
    fragments at ZeRO 3) and the buffers are the saved ones; saved with
    ``exclude_frozen_parameters``, the export leaves the frozen layer out as DeepSpeed's
    own such save does (only the buffers go). Exported as bf16, they are bf16 (as
    DeepSpeed's bf16 module holds them)."""
    from hybrid import deepspeed as hds
    from hybrid.checkpoint.peers import deepspeed as ds
    from hybrid.parallel.state import ParallelState
    rec = _recorder()
    torch.manual_seed(0)
    net = rec.FrozenNet()
    engine, *_ = hds.initialize(model=net,
                                model_parameters=[p for p in net.parameters() if p.requires_grad],
                                config=rec.config(2), mpu=ParallelState.single())
    x, y = rec.batch(0)
    engine.backward(rec.loss_of(engine(x), y))
    engine.step()
    saved = engine.save_checkpoint(str(tmp_path / "hybrid"), exclude_frozen_parameters=exclude)
    want = {k: v.clone() for k, v in net.state_dict().items() if not k.startswith("head.")}
    if exclude:
        want = {k: v for k, v in want.items() if k.startswith("norm.")}
    engine.close()
    for stage in (2, 3):
        out = str(tmp_path / f"ds{stage}")
        ds.write(saved, out, 2, stage)
        back = ds.open(out, names="module")
        assert back.frozen_shapes == ({} if exclude else {"base.weight": [7, 7], "base.bias": [7]})
        assert sorted(back.shapes) == sorted(n for n, p in net.named_parameters()
                                             if p.requires_grad)
        got = back.untrained()
        assert sorted(got) == sorted(want), (stage, sorted(got))
        for k, v in want.items():
            assert torch.equal(got[k], v), (stage, k)
        back.close()
    # as a bf16 run's (module.bfloat16()): the frozen layer and floating buffers in bf16
    for stage in (2, 3):
        out = str(tmp_path / f"bf16_{stage}")
        ds.write(saved, out, 2, stage, dtype="bf16")
        back = ds.open(out, names="module")
        got = back.untrained()
        assert sorted(got) == sorted(want), (stage, sorted(got))
        for k, v in want.items():
            bf16 = v.bfloat16() if v.is_floating_point() else v
            assert got[k].dtype == bf16.dtype and torch.equal(got[k], bf16), (stage, k)
        back.close()


@pytest.mark.peer("deepspeed")
def test_deepspeed_continues_a_frozen_module_s_export(tmp_path):
    """A hybrid.deepspeed FrozenNet (a frozen layer and BatchNorm statistics, saved in
    module_state.pt) exported as DeepSpeed's at ZeRO 2 and 3 (the frozen layer in the
    module and as DeepSpeed's frozen fragments, whole; or partitioned): DeepSpeed 0.19.8,
    its script's own frozen layer drawn from another seed, loads it and its next 5
    losses equal hybrid's within 2e-6."""
    from hybrid.checkpoint.peers import deepspeed as ds
    from tests.helpers.harness import run_ranks
    from tests.helpers.launch import free_port
    steps, save = 5, str(tmp_path / "hybrid")
    losses = run_ranks(_trained_frozen, world_size=2, args=(save, steps))[0]
    for stage in (2, 3):
        out = str(tmp_path / f"ds{stage}")
        ds.write(save, out, 2, stage)
        got = str(tmp_path / f"losses{stage}.json")
        torch.multiprocessing.spawn(_deepspeed_rank, nprocs=2,
                                    args=(free_port(), out, stage, steps, got, True))
        with open(got) as f:
            theirs = json.load(f)
        assert theirs["start"] == 10
        worst = max(abs(a - b) for a, b in zip(theirs["losses"], losses[10:]))
        assert len(theirs["losses"]) == steps and worst <= TOLERANCE, (stage, theirs, losses)


@pytest.mark.parametrize("fixture,layout", [
    ("gpt2_zero2", ["--zero-stage", "2"]), ("gpt2_zero0", ["--tensor-model-parallel-size", "2"]),
    ("llama_zero2", ["--tensor-model-parallel-size", "2"])])
def test_pretrain_gpt_continues_a_deepspeed_hugging_face_run(tmp_path, fixture, layout):
    """The script route: DeepSpeed trained a transformers GPT2LMHeadModel (at ZeRO 2, and
    without ZeRO: one model-state file naming the tied embedding twice), or a
    LlamaForCausalLM (GQA, untied) at ZeRO 2, on 2 ranks, its config.json beside
    ``latest`` as Hugging Face's Trainer leaves it, on the batches ``pretrain_gpt.py``
    reads; ``pretrain_gpt.py --load DS_DIR --save NEW`` imports it through the family's
    name table (the Llama's q, k, v and gate, up fused with their moments) and continues
    with DeepSpeed's next 10 losses: at DeepSpeed's layout (DP 2, ZeRO 2) or at TP 2."""
    from tests.helpers.launch import pretrain, read_json_log
    rec = _recorder()
    d = _copy(fixture, tmp_path)
    want = _after(fixture)
    args = rec.GPT_ARGS if fixture.startswith("gpt2") else rec.LLAMA_ARGS
    log, save = str(tmp_path / "log.json"), tmp_path / "save"
    r = pretrain(2, [*args, *layout, "--load", d, "--save", str(save), "--log-json", log])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = read_json_log(log)
    assert [m["iteration"] for m in lines] == list(range(4, 14))
    assert _worst([m["loss"] for m in lines], want) <= TOLERANCE, (fixture, lines, want)
    meta, params = iter_full_params(str(save / "iter_0000003"), ("master",))
    params.close()
    assert meta["imported_from"]["format"] == f"DeepSpeed ZeRO {fixture[-1]}"
    heads = 2 if fixture.startswith("gpt2") else 4
    assert meta["config"]["num_attention_heads"] == heads and meta["vocab_size"] == 100


def _deepspeed_gpt2_rank(rank: int, port: int, load_dir: str, steps: int, out: str):
    """One DeepSpeed rank of a GPT2LMHeadModel built from the export's config.json: load,
    train ``steps`` on pretrain_gpt.py's batches; rank 0 writes the global losses."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel
    deepspeed.init_distributed(dist_backend="gloo")
    rec = _recorder()
    config = GPT2Config.from_pretrained(load_dir)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config)
    ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
          "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.0,
                                                    "torch_adam": True}},
          "zero_optimization": {"stage": 3}}
    # Hugging Face's Trainer's groups: weight decay on the matrices, none on the biases
    # and norm weights, each in named_parameters() order
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds)
    engine.load_checkpoint(load_dir)
    batch, start, losses = rec.gpt_batches(2, rank), engine.global_steps, []
    for step in range(start, start + steps):
        tokens, labels = batch(step)
        logits = engine(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1))
        losses.append(rec.step_mean(engine, loss, 2))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"start": start, "losses": losses}, f)
    rec.end_rank()


@pytest.mark.peer("deepspeed")
def test_deepspeed_continues_pretrain_gpt_s_export_as_gpt2(tmp_path):
    """pretrain_gpt.py trains 10 steps (TP 2, weight decay 0.1) and saves;
    ``convert_checkpoint.py export --to deepspeed`` writes it for DeepSpeed at DP 2, ZeRO
    3, as a transformers GPT2LMHeadModel with Hugging Face's Trainer's two optimizer
    groups (decay on the matrices only, hybrid's rule too); DeepSpeed loads it into an
    engine built with those groups and its next 3 losses equal hybrid's."""
    pytest.importorskip("transformers")
    from tests.helpers.launch import free_port, pretrain, read_json_log, run_script
    rec, steps = _recorder(), 3
    save, log = str(tmp_path / "hybrid"), str(tmp_path / "log.json")
    args = [a if a != str(rec.SAVED_AT + rec.CONTINUED) else str(10 + steps)
            for a in rec.GPT_ARGS]
    args[args.index("--weight-decay") + 1] = "0.1"  # (on the matrices only: two groups)
    r = pretrain(2, [*args, "--tensor-model-parallel-size", "2", "--save", save,
                     "--save-interval", "10", "--log-json", log])
    assert r.returncode == 0, r.stderr[-3000:]
    ours = [m["loss"] for m in read_json_log(log)][10:]
    out = str(tmp_path / "ds")
    r = run_script("convert_checkpoint", ["export", "--to", "deepspeed",
                                          os.path.join(save, "iter_0000010"), out,
                                          "--dp-size", "2", "--zero-stage", "3"])
    assert r.returncode == 0, r.stderr
    got = str(tmp_path / "theirs.json")
    torch.multiprocessing.spawn(_deepspeed_gpt2_rank, nprocs=2,
                                args=(free_port(), out, steps, got))
    with open(got) as f:
        theirs = json.load(f)
    assert theirs["start"] == 10 and len(ours) == steps
    assert _worst_of(theirs["losses"], ours) <= TOLERANCE, (theirs, ours)


def _worst_of(got, want) -> float:
    assert len(got) == len(want)
    return max(abs(a - b) for a, b in zip(got, want))



# -- bf16 ----------------------------------------------------------------------------------
# DeepSpeed's bf16 saves (the recorder's BF16_CASES): without ZeRO (FP16_UnfusedOptimizer:
# fp32 masters in the model-state file's "optimizer"), ZeRO 1 with BF16_Optimizer
# (Megatron-DeepSpeed's flat partitions, no zero_stage), ZeRO 2 and 3, all in
# bf16_zero_pp_rank_* files. DeepSpeed computes bf16 weight gradients and reduces them
# over DP in bf16 (its grad_accum_dtype, the model's by default; BF16_Optimizer's fp32
# accumulates micro-batches, of which these runs have one a step, after that reduction);
# hybrid under bf16 reduces in fp32 unless data_types.grad_accum_dtype says bf16, so the
# tests say it: then hybrid's arithmetic is DeepSpeed's and the losses match bit for bit.

def _bf16_continue(ps, load_dir: str, stage: int) -> list[float]:
    """:func:`_continue` for a bf16 fixture: its ds_config (bf16, fp32 masters; gradients
    reduced in bf16 as DeepSpeed's were) at hybrid's ZeRO ``stage``, the recorder's bf16
    loss."""
    from hybrid import deepspeed
    rec = _recorder()
    torch.manual_seed(123)  # other initial weights: the load must replace them all
    net = rec.Net()
    config = {**rec.bf16_config(os.path.basename(load_dir)),
              "zero_optimization": {"stage": stage},
              "data_types": {"grad_accum_dtype": "bf16"}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=config, mpu=ps)
    assert net.fc1.weight.dtype == torch.bfloat16
    engine.load_checkpoint(load_dir)
    assert (engine.global_steps, engine.global_samples) == (3, 24)
    losses = [_step(engine, ps, step, bf16=True)
              for step in range(rec.SAVED_AT, rec.SAVED_AT + rec.CONTINUED)]
    engine.close()
    return losses


def _bf16_cases(ps, cases):
    return [_bf16_continue(ps, d, stage) for d, stage in cases]


def test_deepspeed_bf16_checkpoints_continue_bit_for_bit_at_two_ranks(tmp_path):
    """Each bf16 fixture continued at DP 2 under hybrid's bf16 (fp32 masters): at
    DeepSpeed's stage and at others (ZeRO 0's at 2, BF16_Optimizer's at 3, ZeRO 2's at 3,
    ZeRO 3's at 1), one launch. DP 2 rounds the bf16 gradients where DeepSpeed did, so the
    10 losses are DeepSpeed's within fp32's 2e-6 (measured: equal; any weight that rounded
    to another bf16 value would move the loss by about 1e-4)."""
    from tests.helpers.harness import run_ranks
    cases = [(_copy(name, tmp_path / f"{i}"), stage) for i, (name, stage) in enumerate([
        ("net_bf16_zero0", 0), ("net_bf16_zero0", 2), ("net_bf16_zero1", 1),
        ("net_bf16_zero1", 3), ("net_bf16_zero2", 2), ("net_bf16_zero2", 3),
        ("net_bf16_zero3", 3), ("net_bf16_zero3", 1)])]
    out = run_ranks(_bf16_cases, world_size=2, args=(cases,))
    assert out[0] == out[1]
    for (d, stage), got in zip(cases, out[0]):
        want = _after(os.path.basename(d))
        assert _worst(got, want) <= TOLERANCE, (d, stage, got, want)


def _deepspeed_bf16_stage0_values(tag_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """FP16_UnfusedOptimizer's (bf16 without ZeRO): the i-th parameter's master is its
    fp32_groups' i-th, its moments the torch optimizer's state of parameter i."""
    ms = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), weights_only=False,
                    pickle_module=_PICKLE)
    osd = ms["optimizer"]
    state = osd["optimizer_state_dict"]["state"]
    return {n: {"master": osd["fp32_groups"][0][i],
                **{k: state[i][k] for k in ("exp_avg", "exp_avg_sq")}}
            for i, n in enumerate(ms["module"])}


# At DP 1, hybrid's bf16 weight gradient is the whole batch's rounded once, DeepSpeed's
# the mean of two half batches' each rounded to bf16: the updates differ in the last bits
# of the masters, and once a weight rounds to another bf16 value the losses move by about
# 1e-4 (measured worst over these cases: 4.1e-4).
BF16_OTHER_DP_TOLERANCE = 5e-4


def test_one_rank_continues_a_bf16_checkpoint_on_deepspeed_s_fp32_masters(tmp_path):
    """At 1 rank (another DP size) in bf16: hybrid's imported masters and moments are
    DeepSpeed's fp32 values exactly (the masters from DeepSpeed's fp32 partitions or
    fp32_groups, not the bf16 module weights, which are their rounding and differ), and
    the 10 losses are DeepSpeed's within :data:`BF16_OTHER_DP_TOLERANCE`; Adam's step is
    the file's (4 at ZeRO 0: FP16_UnfusedOptimizer steps once with zero gradients when
    built), the iteration 3."""
    from hybrid.parallel.state import ParallelState
    for name, stage in (("net_bf16_zero0", 1), ("net_bf16_zero1", 3), ("net_bf16_zero2", 2),
                        ("net_bf16_zero3", 0)):
        d = _copy(name, tmp_path / name)
        tag = os.path.join(d, "global_step3")
        got = _bf16_continue(ParallelState.single(), d, stage)
        want = (_deepspeed_bf16_stage0_values if name.endswith("0") else
                _deepspeed_full_values)(tag)
        meta, params = iter_full_params(os.path.join(d, "hybrid_import", "iter_0000003"))
        seen = dict(params)
        assert sorted(seen) == sorted(want) == ["fc1.bias", "fc1.weight", "fc2.bias",
                                                "fc2.weight"]
        for n, values in want.items():
            for k, v in values.items():
                assert v.dtype == torch.float32 and torch.equal(seen[n][k], v), (name, n, k)
        assert (meta["step"], meta["iteration"]) == (4 if name.endswith("0") else 3, 3)
        assert _worst(got, _after(name)) <= BF16_OTHER_DP_TOLERANCE, (name, got)
        if name != "net_bf16_zero3":  # (ZeRO 3's module files hold placeholders)
            module = torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"),
                                weights_only=False, pickle_module=_PICKLE)["module"]
            for n, w in module.items():
                assert w.dtype == torch.bfloat16
                assert torch.equal(want[n]["master"].bfloat16(), w), (name, n)
                assert not torch.equal(want[n]["master"], w.float()), (name, n)


def _read_all(path: str) -> None:
    from hybrid.checkpoint.peers import deepspeed as ds
    ck = ds.open(path)
    for n in ck.shapes:
        ck.read(n)


def test_bad_bf16_deepspeed_checkpoints_are_one_error_naming_the_file(tmp_path):
    """A bf16 save's optimizer file without its bf16_ name, or another save's (ZeRO 2's
    among BF16_Optimizer's), or missing: one CheckpointError each, naming the file (fp16
    saves are read: test_peer_deepspeed_fp16.py). BF16_Optimizer's files
    beside a model-state file of ZeRO 0 (its ds_config edited: 0.19.8 builds
    BF16_Optimizer without ZeRO only in a pipeline engine) read as ZeRO 1's."""
    from hybrid.checkpoint.peers import deepspeed as ds
    d = _copy("net_bf16_zero1", tmp_path / "renamed")
    tag = os.path.join(d, "global_step3")
    os.rename(os.path.join(tag, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
              os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(CheckpointError, match=rf"^{tag}/zero_pp_rank_1_mp_rank_00_optim_"
                                              rf"states\.pt: not a bf16 run's optimizer file"):
        _read_all(d)

    d = _copy("net_bf16_zero1", tmp_path / "mixed")
    victim = os.path.join(d, "global_step3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    shutil.copy(os.path.join(FIXTURES, "net_bf16_zero2", "global_step3",
                             os.path.basename(victim)), victim)
    with pytest.raises(CheckpointError, match=rf"^{victim}: zero_stage 2, but bf16_zero_pp_"
                                              rf"rank_0_mp_rank_00_optim_states\.pt holds "
                                              rf"BF16_Optimizer \(files of two saves mixed\)"):
        _read_all(d)

    os.remove(victim)
    with pytest.raises(CheckpointError, match=r"global_step3: DeepSpeed dp_world_size 2 .*"
                                              r"needs bf16_zero_pp_rank_0\.\.1_mp_rank_00"):
        _read_all(d)

    d = _copy("net_bf16_zero1", tmp_path / "stage0")
    path = os.path.join(d, "global_step3", "mp_rank_00_model_states.pt")
    ms = torch.load(path, weights_only=False, pickle_module=_PICKLE)
    ms["ds_config"]["zero_optimization"] = {"stage": 0}
    torch.save(ms, path)
    ck, want = ds.open(d), _deepspeed_full_values(os.path.join(d, "global_step3"))
    assert (ck.format, ck.step) == ("DeepSpeed ZeRO 0", 3)
    for n, values in want.items():
        got = ck.read(n)
        assert all(torch.equal(got[k], v) for k, v in values.items()), n


# -- the bf16 way back -----------------------------------------------------------------------
# hybrid trains the recorder's Net in bf16 (fp32 masters; gradients reduced in bf16, as
# DeepSpeed's are by default) and its checkpoint is written as DeepSpeed's bf16 run saves.

BF16_RUN = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}
# the DeepSpeed configs the bf16 exports are written for (and DeepSpeed loads them with):
# ZeRO 1 with fp32 gradient accumulation builds BF16_Optimizer, ZeRO 1-3 otherwise the ZeRO
# optimizers, no ZeRO FP16_UnfusedOptimizer
BF16_EXPORTS = {"zero0": (0, {}), "zero1": (1, {}),
                "bf16_optimizer": (1, {"data_types": {"grad_accum_dtype": "fp32"}}),
                "zero2": (2, {}), "zero3": (3, {})}


def _bf16_export_config(case: str) -> dict:
    stage, extra = BF16_EXPORTS[case]
    return {**_recorder().config(stage), "bf16": {"enabled": True}, **extra}


def _trained_bf16(ps, save: str, steps: int) -> list[float]:
    """The recorder's Net under hybrid.deepspeed in bf16 at ZeRO 2: 10 steps, a save into
    ``save``, ``steps`` more; every step's global loss."""
    from hybrid import deepspeed as hds
    rec = _recorder()
    torch.manual_seed(0)
    net = rec.Net()
    engine, *_ = hds.initialize(model=net, model_parameters=net.parameters(),
                                config={**rec.config(2), **BF16_RUN}, mpu=ps)
    losses = []
    for step in range(10 + steps):
        if step == 10:
            engine.save_checkpoint(save)
        losses.append(_step(engine, ps, step, bf16=True))
    if not steps:
        engine.save_checkpoint(save)
    engine.close()
    return losses


def _fixture_keys(name: str, file: str) -> list[str]:
    """The keys DeepSpeed 0.19.8 wrote in a bf16 fixture's file (an optimizer file's
    ``optimizer_state_dict``'s)."""
    from hybrid.checkpoint.peers.deepspeed_files import load_file
    got = load_file(os.path.join(FIXTURES, name, "global_step3", file))
    return sorted(got.get("optimizer_state_dict", got))


def test_a_bf16_export_is_deepspeed_s_bf16_files_and_reads_back(tmp_path):
    """A checkpoint hybrid trained in bf16, exported (its own dtype: bf16 by default) for
    DeepSpeed's bf16 configs without ZeRO (FP16_UnfusedOptimizer's state in the
    model-state file), at ZeRO 1 (the ZeRO optimizer's files, and BF16_Optimizer's where
    the ds_config accumulates gradients in fp32), 2 and 3: the files are named and keyed
    as DeepSpeed's own bf16 saves (the fixtures), the module's weights are the masters'
    bf16 rounding (ZeRO 3's placeholders bf16), and hybrid's DeepSpeed reader reads back
    the same fp32 masters, moments and step. The same checkpoint with ``dtype="fp32"`` is
    fp32's files (ZeRO 2, and stage 0: the torch optimizer's state dict). A dtype hybrid
    does not know (fp8), one the given ds_config contradicts, or bf16 without ZeRO
    under fp32 gradient accumulation (DeepSpeed does not start so) is one
    CheckpointError, nothing written (fp16: test_peer_deepspeed_fp16.py)."""
    from hybrid.checkpoint import resolve_checkpoint
    from hybrid.checkpoint.peers import deepspeed as ds, deepspeed_bf16
    from hybrid.checkpoint.peers.deepspeed_files import load_file
    from hybrid.parallel.state import ParallelState
    from tests.helpers.launch import run_script
    save = str(tmp_path / "hybrid")
    _trained_bf16(ParallelState.single(), save, 0)
    meta, params = iter_full_params(resolve_checkpoint(save))
    want = dict(params)
    assert meta["config"]["bf16"] and meta["step"] == 10
    like = {"zero0": ("net_bf16_zero0", None, None),
            "zero1": ("net_zero2", "zero_pp_rank_0", "zero_stage 1"),  # (fp32's: same keys)
            "bf16_optimizer": ("net_bf16_zero1", "bf16_zero_pp_rank_0", "BF16_Optimizer"),
            "zero2": ("net_bf16_zero2", "bf16_zero_pp_rank_0", "zero_stage 2"),
            "zero3": ("net_bf16_zero3", "bf16_zero_pp_rank_0", "zero_stage 3")}
    for case, dp in (("zero0", 2), ("zero1", 2), ("bf16_optimizer", 3), ("zero2", 2),
                     ("zero3", 2)):
        stage = BF16_EXPORTS[case][0]
        config = _bf16_export_config(case) if case == "bf16_optimizer" else None
        out = str(tmp_path / case)
        tag = ds.write(save, out, dp, stage, ds_config=config)
        models = (["mp_rank_00_model_states.pt"] if stage < 3 else
                  [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(dp)])
        assert sorted(os.listdir(tag)) == sorted(
            [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp)
             if stage] + models)
        fixture, first, kind = like[case]
        for r in range(dp if stage else 0):
            osd = load_file(os.path.join(tag, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_"
                                              f"states.pt"))["optimizer_state_dict"]
            assert deepspeed_bf16.optim_kind(osd) == kind, (case, r)
            assert sorted(osd) == _fixture_keys(fixture, f"{first}_mp_rank_00_optim_states.pt")
            if case == "bf16_optimizer":  # (the partition whole; the padding on the last)
                total, part = 122, -(-122 // (2 * dp)) * 2
                assert [t.numel() for t in osd["single_partition_of_fp32_groups"]] == [part]
                assert osd["group_paddings"] == [dp * part - total if r == dp - 1 else 0]
        fixture_model = "mp_rank_00_model_states.pt" if stage < 3 else models[0]
        for m in models:
            ms = load_file(os.path.join(tag, m))
            assert sorted(ms) == _fixture_keys(fixture if stage != 1 else "net_bf16_zero1",
                                               fixture_model)
            if not stage:  # (FP16_UnfusedOptimizer's: the masters in the module's order)
                theirs = load_file(os.path.join(FIXTURES, fixture, "global_step3",
                                                fixture_model))["optimizer"]
                assert sorted(ms["optimizer"]) == sorted(theirs)
                assert list(ms["module"]) == ["fc1.weight", "fc1.bias", "fc2.weight",
                                              "fc2.bias"]
                assert all(torch.equal(t, want[n]["master"]) for n, t in
                           zip(ms["module"], ms["optimizer"]["fp32_groups"][0]))
            assert deepspeed_bf16.bf16_enabled(ms["ds_config"]) is True
            for n, w in ms["module"].items():
                assert w.dtype == torch.bfloat16, (case, n)
                assert (w.numel() == 0 if stage == 3 else
                        torch.equal(w, want[n]["master"].bfloat16())), (case, n)
        back = ds.open(out)
        assert (back.stage, back.world, back.step, back.iteration) == (stage, dp, 10, 10)
        for n, values in want.items():
            got = back.read(n)
            assert all(torch.equal(got[k], v) for k, v in values.items()), (case, n)
        back.close()

    tag = ds.write(save, str(tmp_path / "fp32"), 2, 2, dtype="fp32")
    assert sorted(os.listdir(tag)) == ["mp_rank_00_model_states.pt",
                                       "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                       "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    module = load_file(os.path.join(tag, "mp_rank_00_model_states.pt"))["module"]
    assert all(torch.equal(w, want[n]["master"]) for n, w in module.items())
    tag = ds.write(save, str(tmp_path / "fp32_0"), 2, 0, dtype="fp32")
    assert os.listdir(tag) == ["mp_rank_00_model_states.pt"]
    ms = load_file(os.path.join(tag, "mp_rank_00_model_states.pt"))
    assert sorted(ms["optimizer"]) == ["param_groups", "state"]
    assert all(torch.equal(w, want[n]["master"]) for n, w in ms["module"].items())
    back = ds.open(tag)
    for n, values in want.items():
        got = back.read(n)
        assert all(torch.equal(got[k], v) for k, v in values.items()), n

    # the script: --dtype, --ds-config (the same rules; an error is exit 2, one line)
    r = run_script("convert_checkpoint", ["export", "--to", "deepspeed", save,
                                          str(tmp_path / "cli"), "--dp-size", "2",
                                          "--dtype", "fp32"])
    assert r.returncode == 0 and "ZeRO 2 fp32 checkpoint for DP 2" in r.stdout, r.stderr
    with open(tmp_path / "fp16.json", "w") as f:
        json.dump({**_recorder().config(2), "fp16": {"enabled": True}}, f)
    r = run_script("convert_checkpoint", ["export", "--to", "deepspeed", save,
                                          str(tmp_path / "bad"), "--ds-config",
                                          str(tmp_path / "fp16.json"), "--dtype", "bf16"])
    assert r.returncode == 2 and "but the ds_config given trains in fp16" in r.stderr, r.stderr
    bad = str(tmp_path / "bad")
    with pytest.raises(CheckpointError, match=r"--dtype fp8: fp32, bf16 or fp16"):
        ds.write(save, bad, 2, 2, dtype="fp8")
    with pytest.raises(CheckpointError, match=r"--dtype bf16, but the ds_config given "
                                              r"trains in fp32"):
        ds.write(save, bad, 2, 2, dtype="bf16", ds_config=_recorder().config(2))
    with pytest.raises(CheckpointError, match=r"--dtype fp32, but the ds_config given "
                                              r"trains in fp16"):
        ds.write(save, bad, 2, 2, dtype="fp32", ds_config={**_recorder().config(2),
                                                           "fp16": {"enabled": True}})
    with pytest.raises(CheckpointError, match=r"bf16 without ZeRO \(--zero-stage 0\) under "
                                              r"a ds_config with data_types.grad_accum_dtype "
                                              r"fp32: DeepSpeed 0.19.8 does not train so"):
        ds.write(save, bad, 2, 0, ds_config={**_bf16_export_config("bf16_optimizer"),
                                             "zero_optimization": {"stage": 0}})
    assert not os.path.exists(bad)


def _deepspeed_bf16_rank(rank: int, port: int, cases: list, steps: int, out: str):
    """One DeepSpeed rank: for each ``(load_dir, ds_config)``, a fresh Net (another seed)
    under DeepSpeed's bf16, ``load_checkpoint``, the fp32 masters and moments DeepSpeed
    holds (its safe_get_full_* API), then ``steps`` of the recorder's batches; rank 0
    saves every case's results into ``out``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    deepspeed.init_distributed(dist_backend="gloo")
    rec, results = _recorder(), []
    for load_dir, config in cases:
        torch.manual_seed(77)  # another start: the load must replace it
        net = rec.Net()
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                          config=config)
        path, _ = engine.load_checkpoint(load_dir)
        assert path is not None
        link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # (ZeRO 1-2 link the moments to the parameters at a step)
            link()
        if config["zero_optimization"]["stage"]:
            held = {n: {"master": safe_get_full_fp32_param(p).clone(),
                        **{k: safe_get_full_optimizer_state(p, k).clone()
                           for k in ("exp_avg", "exp_avg_sq")}}
                    for n, p in net.named_parameters()}
        else:  # FP16_UnfusedOptimizer: a master per parameter, in the optimizer's order
            masters = [t for g in engine.optimizer.fp32_groups for t in g]
            state = engine.optimizer.optimizer.state
            held = {n: {"master": m.clone(), **{k: state[m][k].clone()
                                                 for k in ("exp_avg", "exp_avg_sq")}}
                    for (n, _), m in zip(net.named_parameters(), masters)}
        start, per, losses = engine.global_steps, rec.GLOBAL_BATCH // 2, []
        for step in range(start, start + steps):
            x, y = rec.batch(step)
            rows = slice(rank * per, (rank + 1) * per)
            losses.append(rec.step_mean(engine, rec.bf16_loss(engine, x[rows], y[rows]), 2))
        results.append({"start": start, "losses": losses, "held": held,
                        "samples": engine.global_samples,
                        "optimizer": type(engine.optimizer).__name__})
    if rank == 0:
        torch.save(results, out)
    rec.end_rank()


@pytest.mark.peer("deepspeed")
def test_deepspeed_continues_hybrid_s_bf16_export(tmp_path):
    """hybrid.deepspeed trains Net in bf16 at DP 2 (ZeRO 2, gradients reduced in bf16)
    for 10 steps, saves, and trains 5 more; the checkpoint exported as DeepSpeed's bf16
    run's at DP 2 -- without ZeRO (FP16_UnfusedOptimizer's), ZeRO 1 (the ZeRO optimizer's
    files; BF16_Optimizer's through ``convert_checkpoint.py export --to deepspeed
    --ds-config``), 2 and 3 -- is loaded by
    DeepSpeed 0.19.8's own engine.load_checkpoint under that bf16 config: the fp32 masters
    and moments it then holds are hybrid's exactly, and its next 5 losses are hybrid's bit
    for bit (DP 2 rounds the bf16 gradients where hybrid's run did)."""
    from hybrid.checkpoint import resolve_checkpoint
    from hybrid.checkpoint.peers import deepspeed as ds
    from tests.helpers.harness import run_ranks
    from tests.helpers.launch import free_port, run_script
    rec, steps, save = _recorder(), 5, str(tmp_path / "hybrid")
    losses = run_ranks(_trained_bf16, world_size=2, args=(save, steps))[0]
    _, params = iter_full_params(resolve_checkpoint(save))
    want = dict(params)
    cases = []
    for case in BF16_EXPORTS:
        out, config = str(tmp_path / case), _bf16_export_config(case)
        if case == "bf16_optimizer":
            path = str(tmp_path / "ds_config.json")
            with open(path, "w") as f:
                json.dump(config, f)
            r = run_script("convert_checkpoint", ["export", "--to", "deepspeed", save, out,
                                                  "--dp-size", "2", "--zero-stage", "1",
                                                  "--ds-config", path])
            assert r.returncode == 0 and "ZeRO 1 bf16 checkpoint" in r.stdout, r.stderr
        else:  # (the checkpoint's own dtype: bf16)
            ds.write(save, out, 2, BF16_EXPORTS[case][0])
        cases.append((out, config))
    got = str(tmp_path / "theirs.pt")
    torch.multiprocessing.spawn(_deepspeed_bf16_rank, nprocs=2,
                                args=(free_port(), cases, steps, got))
    theirs = torch.load(got, weights_only=True)
    kinds = {"zero0": "FP16_UnfusedOptimizer", "zero1": "DeepSpeedZeroOptimizer",
             "bf16_optimizer": "BF16_Optimizer", "zero2": "DeepSpeedZeroOptimizer",
             "zero3": "DeepSpeedZeroOptimizer_Stage3"}
    for case, result in zip(BF16_EXPORTS, theirs):
        assert result["optimizer"] == kinds[case], (case, result["optimizer"])
        assert result["start"] == 10 and result["samples"] == (10 + steps) * rec.GLOBAL_BATCH
        assert sorted(result["held"]) == sorted(want)
        for n, values in want.items():
            for k, v in values.items():
                assert torch.equal(result["held"][n][k].float(), v), (case, n, k)
        assert result["losses"] == losses[10:], (case, result["losses"], losses[10:])
