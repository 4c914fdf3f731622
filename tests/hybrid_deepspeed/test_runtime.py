"""DeepSpeed's module tree below ``deepspeed``, served or refused by name, in one process
(ParallelState.single()): ``runtime.utils`` (the seeded draws are a reference seeding's),
``runtime.lr_schedules`` (the classes' rates are DeepSpeed 0.19.8's recorded ones, and
drive a client optimizer through ``initialize``), ``ops.adam`` (FusedAdam and
DeepSpeedCPUAdam of one AdamW group train bit for bit as hybrid's own AdamW, the others as
torch's AdamW / Adam), and each refused name's message, as an attribute, as
``from X import Y`` and through the import hook."""

import json
import random
import re
import sys
from pathlib import Path

import numpy
import pytest
import torch
from torch import nn

from hybrid import deepspeed
from hybrid.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from hybrid.deepspeed.runtime import lr_schedules
from hybrid.deepspeed.runtime.utils import see_memory_usage, set_random_seed
from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState
from tests.engine.record_deepspeed_schedules import CASES, LR, PATH, STEPS, deepspeed_rates
from tests.hybrid_deepspeed.test_door import _train
from tests.hybrid_deepspeed.test_tutorials import Net

RECORDED = json.loads(Path(PATH).read_text(encoding="utf-8"))
DS = {"train_batch_size": 4, "gradient_accumulation_steps": 2}


# -- runtime.utils ----------------------------------------------------------------------------

def test_set_random_seed_seeds_python_numpy_and_torch_as_deepspeed():
    seed = 2 ** 40 + 7  # past numpy's 32 bits: taken mod 2**32, as DeepSpeed's does
    set_random_seed(seed)
    got = (random.random(), numpy.random.rand(3).tolist(), torch.rand(3))
    random.seed(seed)
    numpy.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed % 2 ** 63)
    want = (random.random(), numpy.random.rand(3).tolist(), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_see_memory_usage_prints_only_when_forced(capsys):
    see_memory_usage("before the model")
    assert capsys.readouterr().out == ""
    see_memory_usage("before the model", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "before the model"
    assert lines[1].startswith("MA ") and " Max_MA " in lines[1] and " CA " in lines[1]
    assert float(lines[1].split()[1]) > 0  # (the resident set, on a CPU)
    assert lines[2].startswith("CPU Virtual Memory:  used = ") and lines[2].endswith("%")


# -- runtime.lr_schedules ---------------------------------------------------------------------

def _class_rates(block: dict, groups: int = 1) -> list[list[float]]:
    """[rate, beta1, beta2] of each step of the class ``block`` names, over an AdamW of
    ``groups`` groups at ``LR`` (group 0's)."""
    params = [nn.Parameter(torch.zeros(1)) for _ in range(groups)]
    opt = torch.optim.AdamW([{"params": [p]} for p in params], lr=LR)
    sched = getattr(lr_schedules, block["type"])(opt, **block["params"])
    out = []
    for _ in range(STEPS):
        g = opt.param_groups[0]
        out.append([float(g["lr"]), *map(float, g["betas"])])
        sched.step()
    return out


def _flat(rows):
    return [v for row in rows for v in row]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_scheduler_classes_give_deepspeeds_recorded_rates(name):
    case = RECORDED["cases"][name]
    assert _flat(_class_rates(case["scheduler"])) == pytest.approx(
        _flat(case["rates"]), rel=1e-12, abs=1e-15)


@pytest.mark.peer("deepspeed")
def test_set_random_seed_draws_as_deepspeeds():
    from deepspeed.runtime.utils import set_random_seed as theirs
    draws = []
    for fn in (theirs, set_random_seed):
        fn(2 ** 40 + 7)
        draws.append((random.random(), numpy.random.rand(3).tolist(), torch.rand(3).tolist()))
    assert draws[0] == draws[1]


@pytest.mark.peer("deepspeed")
def test_see_memory_usage_prints_deepspeeds_lines(capsys):
    """The same three lines as DeepSpeed 0.19.8's, numbers aside."""
    from deepspeed.runtime.utils import see_memory_usage as theirs
    shapes = []
    for fn in (theirs, see_memory_usage):
        fn("here", force=True)
        shapes.append([re.sub(r"\d+(\.\d+)?", "N", line)  # (not its accelerator's log line)
                       for line in capsys.readouterr().out.splitlines()
                       if not line.startswith("[")])
    assert shapes[0] == shapes[1] and len(shapes[0]) == 3, shapes


@pytest.mark.peer("deepspeed")
def test_the_scheduler_classes_give_the_live_deepspeeds_rates():
    for name, block in CASES.items():
        assert _flat(_class_rates(block)) == pytest.approx(
            _flat(deepspeed_rates(block)), rel=1e-12, abs=1e-15), name


def test_a_per_group_warmup_is_each_groups_own_schedule():
    p, q = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 0.1}, {"params": [q], "lr": 0.2}])
    sched = lr_schedules.WarmupDecayLR(opt, total_num_steps=10, warmup_min_lr=[0.0, 0.01],
                                       warmup_max_lr=[0.1, 0.2], warmup_num_steps=3)
    alone = torch.optim.SGD([q], lr=0.2)
    one = lr_schedules.WarmupDecayLR(alone, total_num_steps=10, warmup_min_lr=0.01,
                                     warmup_max_lr=0.2, warmup_num_steps=3)
    for _ in range(12):
        assert opt.param_groups[1]["lr"] == alone.param_groups[0]["lr"]
        sched.step()
        one.step()
    assert sched.get_last_lr()[0] == 0.0  # past total_num_steps: down to warmup_min_lr


def test_a_scheduler_class_drives_a_client_optimizer_through_initialize():
    """FusedAdam and WarmupCosineLR handed to initialize: each step runs at the class's
    rate for it, as DeepSpeed's engine steps a client scheduler."""
    block = CASES["WarmupCosineLR-linear"]
    want = [row[0] for row in RECORDED["cases"]["WarmupCosineLR-linear"]["rates"]][:6]
    torch.manual_seed(0)
    net = Net()
    opt = FusedAdam(net.parameters(), lr=LR)
    sched = lr_schedules.WarmupCosineLR(opt, **block["params"])
    engine, _, _, got_sched = deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=sched,
                                                   config=DS, mpu=ParallelState.single())
    assert got_sched is sched
    rates = []
    for _ in range(6):
        rates.append(engine.get_lr()[0])
        _train(engine, 1)
    assert rates == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_the_scheduler_classes_refuse_what_hybrid_cannot_honour():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    with pytest.raises(ConfigError, match=r"WarmupLR\(last_batch_iteration=5\): build it "
                                          r"fresh and resume with engine.load_checkpoint"):
        lr_schedules.WarmupLR(opt, last_batch_iteration=5)
    with pytest.raises(ConfigError, match=r"WarmupLR\(warmup_num_steps=...\) must be a "
                                          r"positive whole number, got 0"):
        lr_schedules.WarmupLR(opt, warmup_num_steps=0)
    with pytest.raises(ConfigError, match=r"WarmupLR\(warmup_min_lr=...\): 2 values for 1 "):
        lr_schedules.WarmupLR(opt, warmup_min_lr=[0.0, 0.1])
    with pytest.raises(ConfigError, match=r"OneCycle\(cycle_min_lr=\[...\]\): hybrid's "
                                          r"OneCycle takes one number"):
        lr_schedules.OneCycle(opt, cycle_min_lr=[0.1], cycle_max_lr=1.0)


# -- ops.adam ---------------------------------------------------------------------------------

def _trained(optimizer_of, config=None, steps=3):
    torch.manual_seed(0)
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer_of(net),
                                      config={**DS, **(config or {})},
                                      mpu=ParallelState.single())
    losses = _train(engine, steps)
    return losses, [p.detach().clone() for p in engine.module.parameters()]


def _same(a, b):
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _hybrids(config, steps=3):
    """hybrid's own AdamW: the ds_config's block over a plain list of the parameters."""
    torch.manual_seed(0)
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config={**DS, **config}, mpu=ParallelState.single())
    return _train(engine, steps), [p.detach().clone() for p in engine.module.parameters()]


ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.99), "eps": 1e-7}


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 3},
                                  {"stage": 2, "offload_optimizer": {"device": "cpu"}}])
def test_fused_adam_of_one_group_is_hybrids_own_adamw_bit_for_bit(zero):
    block = {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}}
    want = _hybrids({"zero_optimization": zero, "optimizer": block})
    config = {"zero_optimization": zero}
    _same(_trained(lambda n: FusedAdam(n.parameters(), **ADAMW), config), want)
    _same(_trained(lambda n: DeepSpeedCPUAdam(n.parameters(), **ADAMW), config), want)


def test_a_mapped_fused_adams_groups_are_the_engines(capsys):
    torch.manual_seed(0)
    net = Net()
    opt = FusedAdam(net.parameters(), lr=1e-2)
    engine, optimizer, _, sched = deepspeed.initialize(
        model=net, optimizer=opt, config={**DS, "steps_per_print": 1},
        mpu=ParallelState.single())
    # its betas shown as it holds them (a tuple), as DeepSpeed shows a client FusedAdam's
    assert capsys.readouterr().out.rstrip().endswith(
        "[Rank 0] step=0, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]")
    assert sched is None  # as DeepSpeed's, for a client optimizer without a scheduler
    assert opt.param_groups is optimizer.param_groups and engine.optimizer.client is None
    opt.param_groups[0]["lr"] = 0.5  # a rate written there applies
    assert engine.get_lr() == [0.5]
    with pytest.raises(ConfigError, match=r"FusedAdam.step\(\): initialize runs it as "
                                          r"hybrid's own AdamW .*call engine.step\(\)"):
        opt.step()


def test_fused_adams_hybrid_cannot_run_as_its_own_are_torchs_adam_bit_for_bit():
    """Groups of their own (no decay of biases), the L2 mode, and the CPU one in L2 mode
    under the host offload: torch's Adam(W) stepping the shards."""
    def groups(n):
        return [{"params": [n.fc1.weight, n.fc2.weight]},
                {"params": [n.fc1.bias, n.fc2.bias], "weight_decay": 0.0}]
    want = _trained(lambda n: torch.optim.AdamW(groups(n), **ADAMW))
    _same(_trained(lambda n: FusedAdam(groups(n), **ADAMW)), want)
    want = _trained(lambda n: torch.optim.Adam(n.parameters(), lr=1e-2, weight_decay=0.1))
    _same(_trained(lambda n: FusedAdam(n.parameters(), lr=1e-2, weight_decay=0.1,
                                       adam_w_mode=False)), want)
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    want = _trained(lambda n: torch.optim.Adam(n.parameters(), lr=1e-2, weight_decay=0.1),
                    offload)
    _same(_trained(lambda n: DeepSpeedCPUAdam(n.parameters(), lr=1e-2, weight_decay=0.1,
                                              adamw_mode=False), offload), want)


def test_the_adam_arguments_torch_cannot_honour_are_refused_by_name():
    p = [nn.Parameter(torch.zeros(1))]
    with pytest.raises(ConfigError, match=r"FusedAdam\(bias_correction=False\): hybrid's "
                                          r"Adam always corrects"):
        FusedAdam(p, bias_correction=False)
    with pytest.raises(ConfigError, match=r"FusedAdam\(amsgrad=True\): .*pass "
                                          r"torch.optim.AdamW\(..., amsgrad=True\)"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(ConfigError, match=r"DeepSpeedCPUAdam\(fp32_optimizer_states=False\)"):
        DeepSpeedCPUAdam(p, fp32_optimizer_states=False)


# -- refused names ----------------------------------------------------------------------------

REFUSED = [  # (module under deepspeed, name, words of the advice)
    ("runtime", "pipe", "a pipeline is deepspeed.pipe"),
    ("runtime", "zero", "the context managers are deepspeed.zero"),
    ("runtime", "engine", "hybrid.deepspeed.DeepSpeedEngine"),
    ("runtime.utils", "clip_grad_norm_", "the ds_config's gradient_clipping"),
    ("runtime.lr_schedules", "add_tuning_arguments", "hybrid has no autotuner"),
    ("ops", "lamb", "hybrid has no LAMB"),
    ("ops.adam", "FusedAdamBuilder", "python -m hybrid.kernels"),
    ("utils", "safe_set_full_fp32_param", "GatheredParameters(param, modifier_rank=0)"),
    ("utils", "groups", "engine.ps"),
    ("utils.zero_to_fp32", "convert_zero_checkpoint_to_fp32_state_dict", "torch.save("),
    ("", "monitor", "torch.utils.tensorboard"),
    ("", "profiling", "FlopCounterMode"),
    ("", "init_inference", "scripts/generate.py"),
    ("", "replace_transformer_layer", "hybrid injects no kernels"),
]


@pytest.mark.parametrize(("module", "name", "advice"), REFUSED)
def test_each_refused_name_says_what_instead_as_attribute_and_as_import(module, name, advice):
    ours = "hybrid.deepspeed" + (f".{module}" if module else "")
    said = f"{ours} has no '{name}' (DeepSpeed's {ours.removeprefix('hybrid.')}.{name}): "
    mod = sys.modules[ours] if ours in sys.modules else __import__(ours, fromlist=["_"])
    with pytest.raises(AttributeError) as e:
        getattr(mod, name)
    assert str(e.value).startswith(said) and advice in str(e.value), str(e.value)
    assert not hasattr(mod, name)
    with pytest.raises(ImportError) as e:  # not Python's bare "cannot import name"
        exec(f"from {ours} import {name}", {})
    assert str(e.value).startswith(said) and advice in str(e.value), str(e.value)


@pytest.fixture
def aliased():
    """The import hook of a ``hybrid-deepspeed`` worker, in this process for one test."""
    from hybrid.deepspeed import alias
    if any(m.split(".")[0] == "deepspeed" for m in sys.modules):
        pytest.skip("a deepspeed module is imported in this process")
    hook = alias.install()
    try:
        yield
    finally:
        sys.meta_path.remove(hook)
        for m in [m for m in sys.modules if m.split(".")[0] == "deepspeed"]:
            del sys.modules[m]


@pytest.mark.parametrize(("statement", "said"), [
    ("from deepspeed.runtime.pipe.topology import PipeDataParallelTopology",
     "No module named 'deepspeed.runtime.pipe' under hybrid"),
    ("from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs",
     "No module named 'deepspeed.runtime.zero' under hybrid"),
    ("from deepspeed.ops.lamb import FusedLamb", "hybrid has no LAMB"),
    ("from deepspeed.monitor.monitor import MonitorMaster", "torch.utils.tensorboard"),
    ("from deepspeed.profiling.flops_profiler import get_model_profile", "FlopCounterMode"),
    ("from deepspeed.runtime.lr_schedules import WarmupLR, Nope",
     "hybrid.deepspeed.runtime.lr_schedules has no 'Nope'"),
    ("from deepspeed.utils import safe_get_full_grad, groups",
     "hybrid.deepspeed.utils has no 'groups'"),
])
def test_a_deepspeed_import_hybrid_does_not_serve_fails_in_hybrids_words(aliased, statement,
                                                                        said):
    with pytest.raises(ImportError) as e:
        exec(statement, {})
    assert said in str(e.value) and "docs/deepspeed.md" in str(e.value), str(e.value)


def test_the_served_deepspeed_imports_are_hybrids(aliased):
    scope: dict = {}
    exec("from deepspeed.runtime.lr_schedules import WarmupLR, OneCycle\n"
         "from deepspeed.runtime.utils import set_random_seed, see_memory_usage\n"
         "from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam\n"
         "from deepspeed.utils import logger, log_dist, safe_get_full_fp32_param\n"
         "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n"
         "from deepspeed.runtime.activation_checkpointing import checkpointing as ac\n"
         "from deepspeed.utils import set_z3_leaf_modules\n"
         "from deepspeed import get_accelerator, comm as dist\n"
         "import deepspeed.runtime.activation_checkpointing.checkpointing as ac2\n"
         "import deepspeed\n", scope)
    assert scope["ac"] is scope["ac2"] is scope["deepspeed"].checkpointing  # one module
    assert scope["WarmupLR"] is lr_schedules.WarmupLR and scope["FusedAdam"] is FusedAdam
    assert scope["logger"] is deepspeed.utils.logger
    assert scope["get_accelerator"] is deepspeed.accelerator.get_accelerator
    assert scope["dist"] is deepspeed.comm
    assert scope["set_z3_leaf_modules"] is deepspeed.utils.set_z3_leaf_modules
