"""Learning-rate schedules: each of the ds_config's ``scheduler`` types, and a
``transformers`` schedule handed to ``initialize`` as a client ``lr_scheduler`` over the
engine's optimizer. Six optimizer steps each, so the warmup and what follows both show
in the rates read before each step."""

from __future__ import annotations

import torch

from tests.hybrid_deepspeed.cases.common import SEED, SimpleModel, batches, case, ds_config, train

STEPS = 6


def _scheduled(deepspeed, config, **initialize):
    torch.manual_seed(SEED)
    model = SimpleModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config, **initialize)
    return train(engine, batches(engine.global_rank, STEPS))


@case(ds_config(stage=1, scheduler={"type": "WarmupLR", "params": {
    "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}}))
def warmup_lr(deepspeed, config, workdir):
    """WarmupLR with its default log warmup: 0 -> 0.01 over 4 steps, then constant."""
    return _scheduled(deepspeed, config)


@case(ds_config(stage=1, scheduler={"type": "WarmupDecayLR", "params": {
    "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 2,
    "warmup_type": "linear", "total_num_steps": 6}}))
def warmup_decay_lr(deepspeed, config, workdir):
    """WarmupDecayLR: a linear warmup 0.001 -> 0.01 over 2 steps, then linear decay to
    the end of its 6 steps."""
    return _scheduled(deepspeed, config)


@case(ds_config(stage=1, scheduler={"type": "WarmupCosineLR", "params": {
    "total_num_steps": 6, "warmup_num_steps": 2, "warmup_min_ratio": 0.1,
    "cos_min_ratio": 0.01}}))
def warmup_cosine_lr(deepspeed, config, workdir):
    """WarmupCosineLR: 0.1 x lr -> lr over 2 steps (log warmup), then a cosine down to
    0.01 x lr at step 6 (lr being the optimizer's 0.01)."""
    return _scheduled(deepspeed, config)


@case(ds_config(stage=1, scheduler={"type": "OneCycle", "params": {
    "cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 2,
    "cycle_momentum": False, "decay_lr_rate": 0.5, "decay_step_size": 1}}))
def one_cycle(deepspeed, config, workdir):
    """OneCycle: up 0.001 -> 0.01 in 2 steps, down in 2, then decaying (momentum left
    alone)."""
    return _scheduled(deepspeed, config)


@case(ds_config(stage=1, scheduler={"type": "LRRangeTest", "params": {
    "lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2,
    "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False}}))
def lr_range_test(deepspeed, config, workdir):
    """LRRangeTest: the rate growing from 0.001, one step size every 2 steps."""
    return _scheduled(deepspeed, config)


@case(ds_config(stage=2))
def transformers_schedule(deepspeed, config, workdir):
    """The ds_config's optimizer under ``transformers.get_linear_schedule_with_warmup``
    (2 warmup steps of 6), passed as a callable that ``initialize`` gives the optimizer,
    as DeepSpeed's docs allow."""
    from transformers.optimization import get_linear_schedule_with_warmup

    def schedule(optimizer):
        return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                               num_training_steps=STEPS)

    return _scheduled(deepspeed, config, lr_scheduler=schedule)
