"""``hybrid.deepspeed.pipe`` beyond the recorded scripts (test_against_deepspeed.py runs
those against DeepSpeed 0.19.8): the partition against DeepSpeed's own functions, the
refusals, the tied layer against one process sharing the module, activations passed as
a tuple with an integer member, and PP 2 x DP 2 at every ZeRO stage against one process.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from torch import nn

from hybrid.deepspeed.pipe import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    partition,
    partition_balanced,
    partition_uniform,
)
from hybrid.errors import ConfigError
from tests.helpers.harness import run_ranks
from tests.hybrid_deepspeed.cases.common import SEED, ds_config
from tests.hybrid_deepspeed.cases.pipe import CLASSES, WIDTH, _Embed, _head, _trainset

TOLERANCE = 1e-5


def _worst(got: list[float], want: list[float]) -> float:
    """The largest |difference|; inf for a NaN or a length mismatch."""
    if len(got) != len(want):
        return math.inf
    diffs = [abs(a - b) for a, b in zip(got, want)]
    return math.inf if any(math.isnan(d) for d in diffs) else max(diffs)

# -- partitioning: DeepSpeed's own functions, when it is installed -------------------------

WEIGHTS = [
    [144, 0, 272, 0, 272, 0, 68],
    [5, 5, 5, 5, 5, 5, 5],
    [1, 0, 0, 1, 0, 1, 1, 0, 1],
    [10, 1, 1, 1, 1, 10],
    [0, 0, 0, 3],
    [7, 3, 9, 1, 1, 4, 8, 2, 6, 5],
    [1, 2],
]


def _ds_utils():
    from deepspeed.runtime import utils
    return utils


@pytest.mark.peer("deepspeed")
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_the_partition_is_deepspeeds(parts):
    """parameters / type: balance as DeepSpeed's partition_balanced, uniform as its
    partition_uniform, on lists with ties, zeros and fewer items than parts."""
    utils = _ds_utils()
    for weights in WEIGHTS:
        assert partition_balanced(weights, parts) == list(
            utils.partition_balanced(weights, parts)), (weights, parts)
    for n in range(1, 12):
        assert partition_uniform(n, parts) == list(utils.partition_uniform(n, parts)), n


def _mlp_layers():
    return [LayerSpec(nn.Linear, 8, 16), nn.ReLU(), LayerSpec(nn.Linear, 16, 32),
            nn.ReLU(), nn.Dropout(0.0), LayerSpec(nn.Linear, 32, 4), nn.Tanh(),
            LayerSpec(nn.Linear, 4, 4)]


@pytest.mark.peer("deepspeed")
def test_the_methods_cut_the_layers_as_deepspeed():
    """The three methods on one list of layers, each equal to DeepSpeed's function on
    the weights its PipelineModule derives (parameter counts; a regex search on the class
    name, ignoring case)."""
    utils = _ds_utils()
    layers = _mlp_layers()
    counts = [sum(p.numel() for p in (x.build() if isinstance(x, LayerSpec) else x).parameters())
              for x in layers]
    names = [x.typename.__name__ if isinstance(x, LayerSpec) else type(x).__name__
             for x in layers]
    for stages in (2, 3):
        assert partition(layers, stages, "parameters") == list(
            utils.partition_balanced(counts, stages))
        assert partition(layers, stages, "uniform") == list(
            utils.partition_uniform(len(layers), stages))
        for regex in ("linear", "relu|tanh", "^Lin"):
            hits = [1 if re.search(regex, n, re.IGNORECASE) else 0 for n in names]
            assert partition(layers, stages, f"type:{regex}") == list(
                utils.partition_balanced(hits, stages)), regex
    assert partition(layers, 2, "parameters") == [0, 5, 8]  # (DeepSpeed's: 144+544 | 132+20)


# -- refusals: one ConfigError each, before any process group is needed ----------------------

@pytest.mark.parametrize("kwargs, says", [
    (dict(layers=[nn.ReLU(), nn.ReLU()], num_stages=2), "not a whole number of 2-stage"),
    (dict(layers=[LayerSpec(nn.Linear, 2, 2)], num_stages=2), "leaves stage 1 without a layer"),
    (dict(layers=[nn.ReLU()]), "pass num_stages="),
    (dict(layers=[nn.ReLU()], num_stages=1, topology=object()), "topology"),
    (dict(layers=[nn.ReLU()], num_stages=1, dynamic_shape=True), "dynamic_shape"),
    (dict(layers=[nn.ReLU()], num_stages=1, partition_method="profile"), "profile"),
    (dict(layers=[nn.ReLU()], num_stages=1, partition_method="type:Conv"), "no layer's type"),
    (dict(layers=[TiedLayerSpec("t", nn.Linear, 2, 2), nn.ReLU(),
                  TiedLayerSpec("t", nn.Linear, 2, 2), nn.ReLU()], num_stages=4),
     "hybrid ties layers on one stage, or on the first and the last"),
])
def test_bad_input_is_one_clear_error(kwargs, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        PipelineModule(**kwargs)


def test_one_stage_runs_in_one_process():
    """num_stages=1 without a process group: the stage is every layer, its forward their
    composition."""
    torch.manual_seed(0)
    net = PipelineModule([nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2)], num_stages=1)
    x = torch.randn(4, 3)
    want = net.forward_funcs[2](torch.relu(net.forward_funcs[0](x)))
    assert torch.equal(net(x), want) and net.partitions() == [0, 3]


class _Counted(nn.Linear):
    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


def test_the_checkpoint_interval_recomputes_the_blocks_with_parameters():
    """activation_checkpoint_interval=1 in one process: each Linear's block runs again in
    backward (2 calls each), the ReLU's (no parameters) is not checkpointed; the
    gradients equal the plain forward's."""
    torch.manual_seed(0)
    layers = [_Counted(3, 4), nn.ReLU(), _Counted(4, 2)]
    x = torch.randn(5, 3)
    plain = PipelineModule(layers, num_stages=1)
    plain(x).square().sum().backward()
    want = [p.grad.clone() for p in plain.parameters()]
    plain.zero_grad()
    _Counted.calls = 0
    net = PipelineModule(layers, num_stages=1, activation_checkpoint_interval=1)
    net(x).square().sum().backward()
    assert _Counted.calls == 4
    assert all(torch.equal(p.grad, w) for p, w in zip(net.parameters(), want))


# -- the tied layer against one process sharing the module ----------------------------------

class _Shared(nn.Module):
    """``pipeline_tied``'s layers as one model, the embedding module used twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.embed = _Embed()  # (the first stage's draws, in its build order)
        self.fc1 = nn.Linear(16, 16)
        torch.manual_seed(SEED)  # the last stage's: from the seed again (its own copy of
        self.fc2 = nn.Linear(16, 16)  # the embedding, built after, is the first stage's)

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(torch.relu(self.embed(x)))))
        return _head(self.embed, h)


def test_the_tied_weight_trains_as_one_shared_module():
    """pipeline_tied's recorded losses (DeepSpeed's, which hybrid matches) equal one
    process's where the two occurrences share one module: the sum of the copies'
    gradients is the shared weight's."""
    import json

    from tests.hybrid_deepspeed.record_deepspeed import RECORDED
    with open(RECORDED / "pipeline_tied.json") as f:
        recorded = json.load(f)["ranks"][0]
    model = _Shared()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    x, y = _trainset().tensors
    losses = []
    for step in range(4):
        opt.zero_grad()
        total = 0.0
        for j in range(4):
            i = (4 * step + j) * 4
            loss = nn.functional.cross_entropy(model(x[i:i + 4]), y[i:i + 4] % CLASSES)
            (loss / 4).backward()
            total += loss.item() / 4
        opt.step()
        losses.append(total)
    assert _worst(losses, recorded["losses"]) < TOLERANCE, (losses, recorded["losses"])
    weight = model.embed.weight.detach().flatten().tolist()
    assert _worst(weight, recorded["extra"]["tied_weight"]) < TOLERANCE


# -- tuples between stages, and PP 2 x DP 2 at every ZeRO stage ------------------------------

class _Pair(nn.Module):
    """Stage 0's last layer: the features and an integer mask of which to keep."""

    def forward(self, x):
        return x, (torch.arange(x.shape[-1]) % 3 != 0).to(torch.int64).expand_as(x)


class _Masked(nn.Module):
    def forward(self, pair):
        x, mask = pair
        return x * mask


def _layers(spec):
    return [spec(nn.Linear, WIDTH, 16), nn.ReLU(), _Pair(), _Masked(),
            spec(nn.Linear, 16, 16), nn.Tanh(), spec(nn.Linear, 16, CLASSES)]


def _reference(shards: int, steps: int) -> list[float]:
    """One process: the same layers, built as stage 0 then stage 1 build them (from the
    seed, after the parameter count's builds), trained on every DP rank's micro-batches."""
    torch.manual_seed(SEED)
    for layer in _layers(LayerSpec):
        if isinstance(layer, LayerSpec):
            layer.build()
    after_count = torch.random.get_rng_state()
    built = []
    for lo, hi in ((0, 4), (4, 7)):
        torch.random.set_rng_state(after_count)
        built += [x.build() if isinstance(x, LayerSpec) else x for x in _layers(LayerSpec)[lo:hi]]
    model = nn.Sequential(*built)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    x, y = _trainset().tensors
    per_rank = [list(range(r, len(x), shards)) for r in range(shards)]
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for idx in per_rank:
            for j in range(4):
                # (the engine's loader starts its share again at its end)
                take = [idx[k % len(idx)] for k in range((4 * step + j) * 4,
                                                         (4 * step + j + 1) * 4)]
                loss = nn.functional.cross_entropy(model(x[take]), y[take])
                (loss / (4 * shards)).backward()
                total += loss.item() / (4 * shards)
        opt.step()
        losses.append(total)
    return losses


def _train_stages(ps, stages_of_zero: list[int], steps: int) -> dict[int, list[float]]:
    from hybrid import deepspeed
    out = {}
    for stage in stages_of_zero:
        torch.manual_seed(SEED)
        net = deepspeed.pipe.PipelineModule(
            layers=_layers(deepspeed.pipe.LayerSpec), loss_fn=nn.CrossEntropyLoss(),
            num_stages=2, parallel_state=ps)
        assert net.partitions() == [0, 4, 7]
        config = ds_config(stage=stage, gradient_accumulation_steps=4)
        engine, _, _, _ = deepspeed.initialize(
            model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
            training_data=_trainset(), config=config)
        out[stage] = [float(engine.train_batch()) for _ in range(steps)]
        engine.close()
    return out


def test_pp2_dp2_every_zero_stage_trains_as_one_process():
    """PP 2 x DP 2 (4 ranks): a stage passing (features, int64 mask) to the next, ZeRO
    0-3 over each stage's DP group: every rank's train_batch loss equals one process's
    over both DP shards' data within 1e-5."""
    steps = 3  # (the third runs on the loader's second pass over each DP rank's share)
    want = _reference(2, steps)
    by_rank = run_ranks(_train_stages, world_size=4, pp=2, args=([0, 1, 2, 3], steps))
    for rank, got in enumerate(by_rank):
        for stage, losses in got.items():
            assert _worst(losses, want) < TOLERANCE, (rank, stage, losses, want)


def test_the_pipeline_names_a_script_reaches_for():
    """deepspeed.PipelineModule, deepspeed.pipe.*, deepspeed.utils.RepeatingLoader."""
    from hybrid import deepspeed
    assert deepspeed.PipelineModule is deepspeed.pipe.PipelineModule is PipelineModule
    loader = deepspeed.utils.RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]
    with pytest.raises(AttributeError, match="the process groups are engine.ps"):
        deepspeed.utils.groups  # noqa: B018 (the lookup is the test)


def _train_half(ps, runs: list[tuple[str, int]], steps: int) -> dict:
    """train_batch at PP 2 x DP 2 under each (dtype, initial_scale_power) of ``runs``, the
    inputs given in the model's dtype (as DeepSpeed's pipeline takes them): per run, each
    step's (loss, was_step_applied, the loss scale after it)."""
    from hybrid import deepspeed
    out = {}
    for prec, power in runs:
        torch.manual_seed(SEED)
        net = deepspeed.pipe.PipelineModule(
            layers=_layers(deepspeed.pipe.LayerSpec), loss_fn=nn.CrossEntropyLoss(),
            num_stages=2, parallel_state=ps)
        x, y = _trainset().tensors
        dtype = torch.float16 if prec == "fp16" else torch.bfloat16
        extra = ({"fp16": {"enabled": True, "initial_scale_power": power, "hysteresis": 1}}
                 if prec == "fp16" else {"bf16": {"enabled": True}})
        engine, _, _, _ = deepspeed.initialize(
            model=net, model_parameters=list(net.parameters()),
            training_data=torch.utils.data.TensorDataset(x.to(dtype), y),
            config=ds_config(stage=1, gradient_accumulation_steps=4, **extra))
        out[(prec, power)] = [(float(engine.train_batch()), engine.was_step_applied(),
                               float(engine.optimizer.cur_scale)) for _ in range(steps)]
        engine.close()
    return out


def test_half_precision_train_batch_follows_fp32_and_an_overflow_skips_every_stage():
    """fp16 (loss scale 2**8) and bf16 through train_batch at PP 2 x DP 2, ZeRO 1: every
    step applied, the losses within 1e-3 (fp16) and 4e-3 (bf16) of one fp32 process.
    At a scale of 2**40 every step's fp16 gradient overflows: every rank of both stages
    skips it and halves the scale, and the loss it reports is the true one (scaled in
    fp32, as DeepSpeed's loss scaler does; scaled in fp16 it read inf): step 1's, which
    no update then moves, equal to fp16's first step."""
    steps = 4
    want = _reference(2, steps)
    runs = [("fp16", 8), ("bf16", 0), ("fp16", 40)]
    by_rank = run_ranks(_train_half, world_size=4, pp=2, args=(runs, steps))
    for got in by_rank:
        assert got == by_rank[0]  # (every rank of both stages returns the same)
    got = by_rank[0]
    # (bf16 keeps 8 significant bits: a loss near 1.4 is a multiple of 2**-7, so up to
    # 4e-3 from the fp32 value; fp16's 11 bits: 5e-4)
    for run, tolerance in zip(runs[:2], (1e-3, 4e-3)):
        losses = [loss for loss, _, _ in got[run]]
        assert all(applied for _, applied, _ in got[run]), (run, got[run])
        assert _worst(losses, want) < tolerance, (run, losses, want)
    assert [s for _, _, s in got[("fp16", 8)]] == [256.0] * steps
    skipped = got[("fp16", 40)]
    assert [applied for _, applied, _ in skipped] == [False] * steps, skipped
    assert [s for _, _, s in skipped] == [2.0 ** (39 - i) for i in range(steps)], skipped
    assert skipped[0][0] == got[("fp16", 8)][0][0], (skipped, got[("fp16", 8)])
    assert all(math.isfinite(loss) for loss, _, _ in skipped), skipped


def _save_with_a_buffer_in_stage_1(ps, save_dir: str) -> str:
    from hybrid import deepspeed
    torch.manual_seed(SEED)
    layers = [nn.Linear(WIDTH, 16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
              nn.Linear(16, CLASSES)]
    net = deepspeed.pipe.PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(),
                                        num_stages=2, partition_method="uniform",
                                        parallel_state=ps)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                           config=ds_config(stage=1))
    try:
        engine.save_checkpoint(save_dir)
    except ConfigError as e:
        return str(e)
    finally:
        engine.close()
    return "saved"


def test_a_pipeline_stage_s_buffers_are_refused_by_name_not_lost(tmp_path):
    """A pipeline engine's frozen parameters and buffers live in their stage, and the module
    state file is stage 0's: a save with a BatchNorm in stage 1 is one ConfigError naming
    it on every rank, and nothing is written (before, its statistics were silently not
    saved)."""
    out = run_ranks(_save_with_a_buffer_in_stage_1, world_size=2, pp=2,
                    args=(str(tmp_path / "ckpt"),))
    assert out[0] == out[1]
    assert re.match(r"save_checkpoint: \d\.running_mean of pipeline stage 1 is a frozen "
                    r"parameter or a buffer", out[0]), out[0]
    assert not os.path.exists(tmp_path / "ckpt")
