"""What DeepSpeed's scripts read from ``hybrid.initialize``'s engine beside its verbs:
``engine.optimizer`` (:class:`EngineOptimizer`, with ``param_groups``) and the training
loader of ``training_data=`` (:func:`dataloader_of`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from hybrid.config.sections import AdamWConfig
from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState
from hybrid.zero import ZeroEngine


class EngineOptimizer:
    """``engine.optimizer``: DeepSpeed's view of the shard optimizer the engine steps.

    ``param_groups`` says what hybrid applies: the parameters with weight decay
    (matrices) and those without, each group with the rate of the next step
    (``lr``), ``betas``, ``eps`` and ``weight_decay``. The engine writes them;
    a change made by the caller (a hand-rolled schedule) is not honoured yet, so
    the next optimizer step raises a ConfigError naming it instead of ignoring it.
    The engine's verbs step and clear it: ``step()`` here refuses, ``zero_grad()``
    is the engine's.
    """

    def __init__(self, module: nn.Module, adamw: AdamWConfig, zero: ZeroEngine):
        self._zero = zero
        params = list(module.parameters())
        groups = [([p for p in params if p.ndim >= 2], adamw.weight_decay),
                  ([p for p in params if p.ndim < 2], 0.0)]
        self.param_groups: list[dict[str, Any]] = [
            {"params": ps, "lr": 0.0, "betas": (adamw.beta1, adamw.beta2), "eps": adamw.eps,
             "weight_decay": wd} for ps, wd in groups if ps]
        self._written: list[dict[str, Any]] = []

    def set_next_lr(self, lr: float) -> None:
        """(The engine's) every group's rate for the next step."""
        for g in self.param_groups:
            g["lr"] = lr
        self._written = [{k: v for k, v in g.items() if k != "params"}
                         for g in self.param_groups]

    def check_unchanged(self) -> None:
        """ConfigError naming the first hyperparameter the caller wrote since the engine
        did (hybrid's step takes them from the config, not from the groups yet)."""
        for i, (g, w) in enumerate(zip(self.param_groups, self._written)):
            for k, v in w.items():
                if g.get(k) != v:
                    raise ConfigError(
                        f"engine.optimizer.param_groups[{i}][{k!r}] was set to {g.get(k)!r} "
                        f"(the engine's is {v!r}): hybrid's engine takes its hyperparameters "
                        f"from the config and does not honour writes to param_groups yet; set "
                        f"the ds_config's \"optimizer\" params and \"scheduler\" block instead")

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale the next step uses (1.0 without fp16)."""
        return float(self._zero.scaler.scale)

    cur_scale = loss_scale  # DeepSpeed's fp16 optimizers' name for it

    def zero_grad(self, set_to_none: bool = True) -> None:
        """engine.zero_grad() (backward clears the gradients at each window's start)."""
        self._zero.zero_grad()

    def step(self, closure=None) -> None:
        raise ConfigError("engine.optimizer.step(): hybrid's engine steps its optimizer in "
                          "engine.step() (at the accumulation boundary); call engine.step()")

    def state_dict(self) -> dict:
        raise ConfigError("engine.optimizer.state_dict(): hybrid's optimizer state is sharded "
                          "over the ranks; save it with engine.save_checkpoint(dir)")

    def load_state_dict(self, state: dict) -> None:
        raise ConfigError("engine.optimizer.load_state_dict(): hybrid's optimizer state is "
                          "sharded over the ranks; load it with engine.load_checkpoint(dir)")


def dataloader_of(dataset, ps: ParallelState, batch_size: int, collate_fn=None,
                  drop_last: bool = False, workers: int = 0):
    """DeepSpeed's training loader: this DP rank's share of ``dataset`` through a
    ``DistributedSampler`` (shuffled with its seed 0, the same order every epoch, as
    DeepSpeed's loader, which sets no epoch), ``batch_size`` samples a batch."""
    from torch.utils.data import DataLoader, DistributedSampler
    sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=ps.dp_size,
                                                     rank=ps.dp_rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, num_workers=workers,
                      pin_memory=ps.device.type == "cuda")
