"""``deepspeed.utils`` over hybrid's engine and what DeepSpeed's engines print.

The progress lines (``[Rank 0] step=N, skipped=M, lr=[...], mom=[...]`` from the engine,
``steps: N loss: ... iter time (s): ... samples/sec: ...`` from the pipeline engine)
appear on stdout exactly after every ``steps_per_print``-th step with the engine's own
numbers, and not at all without it; ``log_dist`` and ``logger`` print as DeepSpeed's;
``safe_get_full_fp32_param`` / ``_grad`` / ``_optimizer_state`` are the master, the
reduced gradient and the moments whole (at DP 2 under ZeRO-3 against one process), and
``zero_to_fp32`` reads a checkpoint back into the engine's parameters bit for bit."""

import logging
import re

import pytest
import torch
from torch import nn

from hybrid import deepspeed
from hybrid.deepspeed.pipe import LayerSpec, PipelineModule
from hybrid.deepspeed.utils import (
    get_z3_leaf_modules,
    log_dist,
    logger,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from hybrid.deepspeed.utils.zero_to_fp32 import (
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from hybrid.errors import CheckpointError, ConfigError
from hybrid.parallel.state import ParallelState
from tests.helpers.foreign_checkpoints import FOREIGN, write_foreign
from tests.helpers.harness import run_ranks
from tests.hybrid_deepspeed.test_door import _train
from tests.hybrid_deepspeed.test_tutorials import Net

ADAM = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
DS = {"train_batch_size": 4, "gradient_accumulation_steps": 2, **ADAM}
STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[INFO\] \[[^\]]+\] ")


def _engine(config, **kw):
    torch.manual_seed(0)
    net = Net()
    kw.setdefault("model_parameters", net.parameters())
    return deepspeed.initialize(model=net, config=config, mpu=ParallelState.single(), **kw)[0]


def _logged(out: str) -> list[str]:
    """The logged messages of ``out`` (stdout), without the time and place DeepSpeed's
    format puts before them."""
    return [STAMP.sub("", line) for line in out.splitlines() if STAMP.match(line)]


# -- the progress lines -----------------------------------------------------------------------

def test_the_engine_logs_deepspeeds_line_every_steps_per_print_steps(capsys):
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                            "warmup_num_steps": 4, "warmup_type": "linear"}}
    engine = _engine({**DS, "steps_per_print": 2, "scheduler": sched})
    want = [f"[Rank 0] step=0, skipped=0, lr={engine.get_lr()}, mom=[(0.9, 0.999)]"]
    for step in range(1, 6):
        _train(engine, 1)
        if step % 2 == 0:
            want.append(f"[Rank 0] step={step}, skipped=0, lr={engine.get_lr()}, "
                        f"mom=[(0.9, 0.999)]")
    assert _logged(capsys.readouterr().out) == want
    assert want[2] == "[Rank 0] step=4, skipped=0, lr=[0.0075], mom=[(0.9, 0.999)]"
    assert engine.get_mom() == [(0.9, 0.999)] and engine.skipped_steps == 0


def test_the_line_counts_fp16s_skipped_steps_and_shows_sgds_momentum(capsys):
    net_config = {"train_batch_size": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1,
                  "fp16": {"enabled": True, "initial_scale_power": 32, "hysteresis": 1}}
    torch.manual_seed(0)
    net = Net().half()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=net_config,
                                      mpu=ParallelState.single())
    skipped, want = 0, []
    for step in range(1, 5):
        x = torch.randn(2, 12).half()
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        skipped += not engine.was_step_applied()
        want.append(f"[Rank 0] step={step}, skipped={skipped}, lr=[0.1], mom=[0.9]")
    assert skipped > 0  # (2**32 overflows fp16 at first)
    assert engine.skipped_steps == skipped and engine.get_mom() == [0.9]
    assert _logged(capsys.readouterr().out)[1:] == want


@pytest.mark.parametrize(("params", "mom"), [
    ({"betas": [0.9, 0.99]}, "[[0.9, 0.99]]"),  # DeepSpeed's FusedAdam keeps the JSON list
    ({"betas": [0.9, 0.99], "torch_adam": True}, "[(0.9, 0.99)]"),  # torch's makes a tuple
    ({}, "[(0.9, 0.999)]")])
def test_the_betas_show_as_deepspeeds_optimizer_holds_them(capsys, params, mom):
    """As DeepSpeed 0.19.8 printed them for these blocks (its FusedAdam built on the CPU)."""
    _engine({**DS, "steps_per_print": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": 0.01, **params}}})
    assert _logged(capsys.readouterr().out) == [
        f"[Rank 0] step=0, skipped=0, lr=[0.01], mom={mom}"]


def test_without_steps_per_print_nothing_is_printed(capsys):
    engine = _engine(DS)
    _train(engine, 3)
    assert capsys.readouterr().out == ""


def test_the_pipeline_engine_prints_deepspeeds_steps_line(capsys):
    torch.manual_seed(0)
    net = PipelineModule(layers=[LayerSpec(nn.Linear, 4, 8), nn.ReLU(),
                                 LayerSpec(nn.Linear, 8, 2)], num_stages=1,
                         loss_fn=nn.functional.cross_entropy,
                         parallel_state=ParallelState.single())
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config={**DS, "steps_per_print": 2})
    g = torch.Generator().manual_seed(0)
    data = iter([(torch.randn(2, 4, generator=g), torch.randint(0, 2, (2,), generator=g))
                 for _ in range(10)])
    losses = [float(engine.train_batch(data)) for _ in range(5)]
    out = capsys.readouterr().out.splitlines()
    printed = [line for line in out if line.startswith("steps: ")]
    assert [line.split(" iter time")[0] for line in printed] == [
        f"steps: 2 loss: {losses[1]:0.4f}", f"steps: 4 loss: {losses[3]:0.4f}"]
    for line in printed:
        m = re.fullmatch(r"steps: \d+ loss: \S+ iter time \(s\): (\d+\.\d{3}) "
                         r"samples/sec: (\d+\.\d{3})", line)
        assert m is not None, line
        assert float(m.group(2)) > 0
    # the engine's line comes first, as DeepSpeed's step logs it before the print
    assert [line.split("] ", 3)[-1] for line in out if "[Rank 0]" in line] == [
        "[Rank 0] step=0, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]",
        "[Rank 0] step=2, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]",
        "[Rank 0] step=4, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]"]
    assert out.index(printed[0]) == 1 + next(i for i, line in enumerate(out)
                                             if "step=2," in line)


# -- logger and log_dist -----------------------------------------------------------------------

def test_log_dist_and_the_logger_print_as_deepspeeds(capsys):
    assert logger is deepspeed.utils.logger and logger.name == "hybrid.deepspeed"
    log_dist("hello", ranks=[0])  # no process group here: every process, as rank -1
    log_dist("quiet", ranks=[0], level=logging.DEBUG)
    logger.info("plain")
    logger.warning("careful")
    out = capsys.readouterr().out
    assert _logged(out) == ["[Rank -1] hello", "plain"]
    assert "[WARNING]" in out and out.rstrip().endswith("careful")


# -- safe_get_full_* --------------------------------------------------------------------------

def test_the_full_fp32_master_is_the_master_not_the_bf16_parameter():
    engine = _engine({**DS, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 12).bfloat16()).float().pow(2).mean())
        engine.step()
    for p in engine.module.parameters():
        master = safe_get_full_fp32_param(p)
        assert master is not None and master.dtype == torch.float32 and master.shape == p.shape
        assert torch.equal(master.to(torch.bfloat16), p.detach())
        assert not torch.equal(master, p.detach().float())  # (finer than bf16)
    frozen = nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match=r"safe_get_full_fp32_param\(param\): the tensor is "
                                          r"not a parameter of a model passed to initialize"):
        safe_get_full_fp32_param(frozen)
    with pytest.raises(ConfigError, match=r"safe_get_full_optimizer_state\(param, 'momentum'\)"
                                          r": the optimizer keeps exp_avg, exp_avg_sq"):
        safe_get_full_optimizer_state(engine.module.fc1.weight, "momentum")


def _full_values(ps, stage, tmp):
    """At DP 2: after two steps, each parameter's master and first moment whole, the
    third step's reduced gradient read at its boundary, and the checkpoint saved after it
    read back by zero_to_fp32 beside the masters then."""
    torch.manual_seed(0)
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config={**DS, "train_batch_size": 8,
                                              "zero_optimization": {"stage": stage}}, mpu=ps)
    mine = _batches()[ps.dp_rank::2]  # this rank's half of each global batch
    out: dict = {}
    for k, (x, y) in enumerate(mine):
        if k == 4:
            out["master"] = {n: safe_get_full_fp32_param(p)
                             for n, p in engine.module.named_parameters()}
            out["exp_avg"] = {n: safe_get_full_optimizer_state(p, "exp_avg")
                              for n, p in engine.module.named_parameters()}
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        if k == 5:  # the boundary's backward done, its step not yet
            out["grad"] = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
        engine.step()
    engine.save_checkpoint(tmp)
    out["saved"] = get_fp32_state_dict_from_zero_checkpoint(tmp)
    out["now"] = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    engine.close()
    return out


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(2, 12, generator=g), torch.randint(0, 4, (2,), generator=g))
            for _ in range(12)]


def _reference():
    """One process over the same global batches: the parameters and first moments after
    two steps (torch's AdamW, hybrid's arithmetic) and the third batch's mean gradient."""
    batches = _batches()
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(2):
        opt.zero_grad()
        for x, y in batches[4 * step: 4 * step + 4]:
            (nn.functional.cross_entropy(net(x), y) / 4).backward()
        opt.step()
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in net.named_parameters()}
    opt.zero_grad()
    for x, y in batches[8:12]:
        (nn.functional.cross_entropy(net(x), y) / 4).backward()
    return ({n: p.detach().clone() for n, p in net.named_parameters()}, moments,
            {n: p.grad.clone() for n, p in net.named_parameters()})


def test_the_full_values_are_whole_at_dp2_and_zero_to_fp32_reads_them_back(tmp_path):
    masters, moments, grads = _reference()
    for stage in (0, 3):
        res = run_ranks(_full_values, world_size=2, args=(stage, str(tmp_path / str(stage))))
        for rank, got in enumerate(res):
            for name in masters:
                for key, want in (("master", masters), ("exp_avg", moments), ("grad", grads)):
                    torch.testing.assert_close(got[key][name], want[name], rtol=1e-5,
                                               atol=1e-6, msg=f"{stage} {rank} {key} {name}")
                    assert torch.equal(got[key][name], res[0][key][name])  # every rank's
                assert torch.equal(got["saved"][name], got["now"][name]), (stage, name)
            assert sorted(got["saved"]) == sorted(masters)


def test_zero_to_fp32_follows_tags_and_steps_as_load_checkpoint_does(tmp_path):
    engine = _engine(DS)
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path))  # iter_0000001, latest names it
    first = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path), tag="best")  # best/, latest names it
    now = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for sd, want in ((get_fp32_state_dict_from_zero_checkpoint(str(tmp_path)), now),
                     (get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag=1), first),
                     (get_fp32_state_dict_from_zero_checkpoint(str(tmp_path),
                                                               tag="global_step1"), first),
                     (get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "iter_0000001")),
                      first)):
        assert sorted(sd) == sorted(want) and all(torch.equal(sd[n], want[n]) for n in want)
    torch.manual_seed(1)
    fresh = load_state_dict_from_zero_checkpoint(Net(), str(tmp_path), tag="best")
    assert all(torch.equal(p, now[n]) for n, p in fresh.named_parameters())
    with pytest.raises(CheckpointError, match=r"tag='nope'\): no save of that tag there"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="nope")
    with pytest.raises(CheckpointError, match="no such directory"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "missing"))
    write_foreign(tmp_path / "theirs", FOREIGN["DeepSpeed"])
    with pytest.raises(CheckpointError, match=r"it holds a DeepSpeed checkpoint \(.*"
                                              r"mp_rank_00_model_states.pt\); hybrid reads "
                                              r"the checkpoints its engine saved"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "theirs"))


PROGRESS_SCRIPT = """
import logging, sys, torch
from torch import nn
{imports}
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
config = {{"train_batch_size": 2, "gradient_accumulation_steps": 1, "steps_per_print": 2,
          "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "torch_adam": True}}}},
          "scheduler": {{"type": "WarmupLR", "params": {{
              "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
              "warmup_type": "linear"}}}}}}
engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
g = torch.Generator().manual_seed(1)
for _ in range(5):
    x, y = torch.randn(2, 12, generator=g), torch.randint(0, 4, (2,), generator=g)
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    engine.step()
"""


def _progress_lines(tmp_path, imports: str) -> list[str]:
    import os
    import subprocess
    import sys

    from tests.helpers.launch import free_port
    script = tmp_path / "progress.py"
    script.write_text(PROGRESS_SCRIPT.format(imports=imports))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300, check=False, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    return [line[line.index("[Rank 0] step="):] for line in done.stdout.splitlines()
            if "[Rank 0] step=" in line]


@pytest.mark.peer("deepspeed")
def test_the_engines_line_is_deepspeeds(tmp_path):
    """The same script under DeepSpeed 0.19.8 (its logger lowered to INFO, where 0.19.8
    keeps it at WARNING) and under hybrid: the same ``[Rank 0] step=...`` lines."""
    theirs = _progress_lines(tmp_path, "import deepspeed\nfrom deepspeed.utils import logger\n"
                                       "logger.setLevel(logging.INFO)\n"
                                       "[h.setLevel(logging.INFO) for h in logger.handlers]")
    ours = _progress_lines(tmp_path, "import hybrid.deepspeed as deepspeed")
    assert len(theirs) == 3 and ours == theirs, (ours, theirs)


def _printed(ps):
    """At DP 2 (or PP 2 with ``ps`` a pipeline's): what each rank printed over two steps
    with steps_per_print 1, and its log_dist calls."""
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        torch.manual_seed(0)
        if ps.pp_size > 1:
            net = PipelineModule(layers=[LayerSpec(nn.Linear, 4, 8), nn.ReLU(),
                                         LayerSpec(nn.Linear, 8, 2)], num_stages=2,
                                 loss_fn=nn.functional.cross_entropy, parallel_state=ps)
            engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                              config={**DS, "steps_per_print": 1})
            g = torch.Generator().manual_seed(0)
            data = iter([(torch.randn(2, 4, generator=g), torch.randint(0, 2, (2,), generator=g))
                         for _ in range(4)])
            losses = [float(engine.train_batch(data)) for _ in range(2)]
        else:
            net = Net()
            engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                              config={**DS, "train_batch_size": 8,
                                                      "steps_per_print": 1}, mpu=ps)
            losses = _train(engine, 2, seed=ps.rank)
        log_dist("to one", ranks=[1])
        log_dist("to all", ranks=[-1])
        engine.close()
    return out.getvalue(), losses


@pytest.mark.parametrize("pipeline", [False, True])
def test_only_global_rank_0_prints_the_lines_and_log_dist_picks_its_ranks(pipeline):
    """DP 2, or PP 2 (the two ranks the two stages): the engine's lines on rank 0 only,
    the pipeline's ``steps:`` line too; log_dist on the ranks asked for."""
    (out0, losses0), (out1, _) = run_ranks(_printed, world_size=2, pp=2 if pipeline else 1)
    assert _logged(out1) == ["[Rank 1] to one", "[Rank 1] to all"]
    steps = ["[Rank 0] step=0, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]",
             "[Rank 0] step=1, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]",
             "[Rank 0] step=2, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]"]
    assert _logged(out0) == [*steps, "[Rank 0] to all"]
    printed = [line.split(" iter time")[0] for line in out0.splitlines()
               if line.startswith("steps: ")]
    assert printed == ([f"steps: {k + 1} loss: {losses0[k]:0.4f}" for k in range(2)]
                       if pipeline else [])
    assert "steps: " not in out1


PIPE_SCRIPT = """
import torch
from torch import nn
{imports}
from deepspeed.pipe import LayerSpec, PipelineModule
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
net = PipelineModule(layers=[LayerSpec(nn.Linear, 4, 8), nn.ReLU(), LayerSpec(nn.Linear, 8, 2)],
                     num_stages=1, loss_fn=nn.functional.cross_entropy)
config = {{"train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_print": 2,
          "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "torch_adam": True}}}}}}
engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
g = torch.Generator().manual_seed(0)
data = iter([(torch.randn(2, 4, generator=g), torch.randint(0, 2, (2,), generator=g))
             for _ in range(10)])
for _ in range(5):
    engine.train_batch(data)
"""


@pytest.mark.peer("deepspeed")
def test_the_pipeline_line_is_deepspeeds(tmp_path):
    """The same pipeline script under DeepSpeed 0.19.8 and under hybrid (hybrid's import
    hook, as hybrid-deepspeed runs it): the ``steps:`` lines at the same steps, in the
    same format, with the same losses to the 4 decimals printed."""
    import os
    import subprocess
    import sys

    from tests.helpers.launch import free_port
    runs = {}
    for who, imports in (("deepspeed", "import deepspeed"),
                         ("hybrid", "from hybrid.deepspeed import alias\nalias.install()\n"
                                    "import deepspeed")):
        script = tmp_path / f"pipe_{who}.py"  # (not deepspeed.py: it would shadow it)
        script.write_text(PIPE_SCRIPT.format(imports=imports))
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu",
               "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              env=env, timeout=300, check=False, cwd=str(tmp_path))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[who] = [line for line in done.stdout.splitlines() if line.startswith("steps: ")]
    shape = re.compile(r"steps: (\d+) loss: (\d+\.\d{4}) iter time \(s\): \d+\.\d{3} "
                       r"samples/sec: \d+\.\d{3}")
    got = {who: [shape.fullmatch(line).groups() for line in lines]  # type: ignore[union-attr]
           for who, lines in runs.items()}
    assert [s for s, _ in got["deepspeed"]] == ["2", "4"], runs
    assert got["hybrid"] == got["deepspeed"], runs


# -- set_z3_leaf_modules ----------------------------------------------------------------------

class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return sum(w(x) for w in self.w)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.moe = nn.Linear(8, 8), _Experts()

    def forward(self, x):
        return self.moe(torch.tanh(self.attn(x)))


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class _LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.decoder, self.out = nn.Linear(4, 8), _Decoder(), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.decoder(self.inp(x))).pow(2).mean()


def _stage3_units(leaves) -> tuple[list[list[str]], list[float]]:
    """The parameters (by name) of each unit stage 3 gathers around a module's run, and
    four steps' losses, with ``leaves`` marked by set_z3_leaf_modules."""
    torch.manual_seed(0)
    model = _LM()
    if leaves:
        named = {c if isinstance(c, str) else c.__name__ for c in leaves}
        assert set_z3_leaf_modules(model, leaves) == [m for m in model.modules()
                                                      if type(m).__name__ in named]
    engine = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), mpu=ParallelState.single(),
        config={"train_batch_size": 2, **ADAM,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})[0]
    names = {id(p): n for n, p in model.named_parameters()}
    units = [[names[id(p)] for p in u.params] for u in engine.zero.units
             if u.name.startswith("module")]
    losses = []
    for i in range(4):
        loss = engine(torch.randn(2, 4, generator=torch.Generator().manual_seed(i)))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return units, losses


def test_leaf_modules_set_what_stage_3_gathers_as_one_and_not_the_numbers():
    """DeepSpeed's set_z3_leaf_modules: stage 3 gathers each transformer layer as one unit
    already, so experts marked inside a layer change nothing; the decoder marked takes the
    place of its layers (one unit of all of them); the losses are the same."""
    layers, losses = _stage3_units([])
    assert [len(u) for u in layers] == [8, 8, 8]
    assert layers[0][:2] == ["decoder.layers.0.attn.weight", "decoder.layers.0.attn.bias"]
    assert _stage3_units(["_Experts"]) == (layers, losses)
    whole, same = _stage3_units([_Decoder])
    assert whole == [sum(layers, [])] and same == losses
    model = _LM()
    with pytest.raises(ValueError, match=r"no module of the classes \['_Missing'\]"):
        set_z3_leaf_modules(model, ["_Missing"])
    assert set_z3_leaf_modules(model, ["_Missing"], raise_if_not_found=False) == []
    set_z3_leaf_modules(model, [_Experts])
    assert [z3_leaf_module(m) for m in model.decoder.layers[0].children()] == [False, True]
    assert len(get_z3_leaf_modules(model)) == 3
    unset_z3_leaf_modules(model, ["_Experts"])
    assert get_z3_leaf_modules(model) == []
