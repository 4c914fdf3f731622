"""DeepSpeed's pipeline scripts (DeepSpeedExamples' ``pipeline_parallelism/train.py`` shape):
a ``deepspeed.pipe.PipelineModule`` of layers and ``LayerSpec``s cut into 2 stages (at 2
ranks: PP 2 x DP 1), trained by ``engine.train_batch()`` of 4 micro-batches a step.

Both ranks record the same numbers: ``train_batch`` returns the step's mean loss on
every stage. ``losses`` holds one value per step, not per micro-batch."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.hybrid_deepspeed.cases.common import SEED, Result, case, ds_config

STEPS = 4
WIDTH, CLASSES = 8, 4


def _pipe_config(stage: int = 1) -> dict:
    return ds_config(stage=stage, gradient_accumulation_steps=4)


def _trainset(samples: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(samples, WIDTH, generator=g),
                         torch.randint(0, CLASSES, (samples,), generator=g))


def _train(engine, steps: int, data_iter=None) -> Result:
    result: Result = {"losses": [], "lrs": [], "extra": {}}
    for _ in range(steps):
        result["lrs"].append(engine.get_lr()[0])
        loss = engine.train_batch() if data_iter is None else engine.train_batch(data_iter)
        result["losses"].append(float(loss))
    return result


@case(_pipe_config(), stages=2)
def pipeline_mlp(deepspeed, config, workdir):
    """An MLP of 7 layers (4 ``LayerSpec(nn.Linear)``, 3 ``nn.ReLU()`` modules), 2 stages
    by parameter count, ``CrossEntropyLoss`` as ``loss_fn``, ``training_data=`` a dataset
    (the engine's own loader), 4 steps of ``train_batch()``; also the eval loss of one
    batch after training (``eval_batch``)."""
    pipe = deepspeed.pipe
    torch.manual_seed(SEED)
    layers = [pipe.LayerSpec(nn.Linear, WIDTH, 16), nn.ReLU(),
              pipe.LayerSpec(nn.Linear, 16, 16), nn.ReLU(),
              pipe.LayerSpec(nn.Linear, 16, 16), nn.ReLU(),
              pipe.LayerSpec(nn.Linear, 16, CLASSES)]
    net = pipe.PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                              partition_method="parameters", activation_checkpoint_interval=0)
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=_trainset(), config=config)
    result = _train(engine, STEPS)
    evalset = _trainset(16)
    batches = iter([(evalset.tensors[0][i:i + 4], evalset.tensors[1][i:i + 4])
                    for i in range(0, 16, 4)])
    result["extra"]["eval_loss"] = [float(engine.eval_batch(batches))]
    return result


class _Embed(nn.Module):
    """A tied 'embedding' of a float input: ``x @ W^T``, ``W`` of ``(16, WIDTH)``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, WIDTH) * 0.3)
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return x @ self.weight.t() + self.bias


def _head(module: _Embed, x):
    """The tied head: the embedding's transpose, ``(.., 16) -> (.., WIDTH)``."""
    return x @ module.weight


@case(_pipe_config(), stages=2)
def pipeline_tied(deepspeed, config, workdir):
    """A ``TiedLayerSpec`` on the first and the last stage (an embedding and its
    transpose as the head, by ``forward_fn``), between them 2 ``LayerSpec(nn.Linear)``
    and ReLUs, 2 stages, 4 steps of ``train_batch(data_iter)`` over an iterator of
    batches; also the tied weight on each rank after training (its two copies)."""
    pipe = deepspeed.pipe
    torch.manual_seed(SEED)
    layers = [pipe.TiedLayerSpec("embed", _Embed), nn.ReLU(),
              pipe.LayerSpec(nn.Linear, 16, 16), nn.ReLU(),
              pipe.LayerSpec(nn.Linear, 16, 16),
              pipe.TiedLayerSpec("embed", _Embed, forward_fn=_head)]
    net = pipe.PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                              partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=config)
    trainset = _trainset()
    data = [(trainset.tensors[0][i:i + 4], trainset.tensors[1][i:i + 4] % CLASSES)
            for i in range(0, 64, 4)]
    result = _train(engine, STEPS, iter(data))
    result["extra"]["tied_weight"] = net.tied_modules["embed"].weight.detach().flatten().tolist()
    return result


@case(_pipe_config(stage=0), stages=2)
def pipeline_checkpointed(deepspeed, config, workdir):
    """DeepSpeed's other module options: ``seed_layers=True`` (each layer built from
    ``base_seed`` 7 plus its index; with ``partition_method="uniform"``: DeepSpeed 0.19.8
    seeds Python's ``random`` with a numpy integer after a balanced partition, a
    TypeError), ``activation_checkpoint_interval=2`` (blocks of two layers recomputed
    in backward), ZeRO 0, 3 steps; also a checkpoint after step 2, resumed into a fresh
    engine (a fresh module from the same seeds) for step 3: ``resumed_losses``."""
    pipe = deepspeed.pipe

    def build():
        layers = [pipe.LayerSpec(nn.Linear, WIDTH, 16), nn.ReLU(),
                  pipe.LayerSpec(nn.Linear, 16, 16), nn.GELU(), nn.Dropout(0.0),
                  pipe.LayerSpec(nn.Linear, 16, 16), nn.ReLU(),
                  pipe.LayerSpec(nn.Linear, 16, CLASSES)]
        net = pipe.PipelineModule(layers=layers, loss_fn=nn.CrossEntropyLoss(), num_stages=2,
                                  partition_method="uniform", seed_layers=True, base_seed=7,
                                  activation_checkpoint_interval=2)
        return deepspeed.initialize(
            model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
            training_data=_trainset(), config=dict(config))[0]

    engine = build()
    result = _train(engine, 2)
    engine.save_checkpoint(workdir, tag="step2")
    result["losses"] += _train(engine, 1)["losses"]
    resumed = build()
    resumed.load_checkpoint(workdir, tag="step2")
    result["extra"]["resumed_losses"] = _train(resumed, 1)["losses"]
    return result
