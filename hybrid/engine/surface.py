"""What DeepSpeed's scripts read from ``hybrid.initialize``'s engine beside its verbs:
``engine.optimizer`` (:class:`EngineOptimizer`, with ``param_groups``) and the training
loader of ``training_data=`` (:func:`dataloader_of`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hybrid.config.sections import AdamWConfig
from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState
from hybrid.zero import ZeroEngine

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, Dataset


class EngineOptimizer:
    """``engine.optimizer``: DeepSpeed's view of the optimizer the engine steps.

    ``param_groups`` are the groups whose hyperparameters apply: a client
    optimizer's own (:mod:`hybrid.engine.optimizer`; their ``params`` are views
    of this rank's shard, as DeepSpeed's flat partitions), or, for hybrid's
    AdamW, one group of the parameters given, with ``lr``, ``betas``, ``eps``
    and ``weight_decay``. A schedule writes each group's ``lr`` (the rate of the
    next step), and so may the caller: the next step applies it. hybrid's AdamW
    takes its other hyperparameters from the config, so a change to them raises
    a ConfigError naming it at the next step instead of being ignored. The
    engine's verbs step and clear it: ``step()`` here refuses, ``zero_grad()`` is
    the engine's.
    """

    def __init__(self, params: list, adamw: AdamWConfig, zero: ZeroEngine,
                 client: torch.optim.Optimizer | None = None):
        self._zero, self.client = zero, client
        self.param_groups: list[dict[str, Any]] = (
            client.param_groups if client is not None else
            [{"params": params, "lr": 0.0, "betas": (adamw.beta1, adamw.beta2),
              "eps": adamw.eps, "weight_decay": adamw.weight_decay}])
        self._fixed = ([] if client is not None else
                       [{k: v for k, v in g.items() if k not in ("params", "lr")}
                        for g in self.param_groups])

    @property
    def state(self) -> dict:
        """The client optimizer's state (this rank's shard's); hybrid's AdamW keeps its
        moments in flat buffers: empty here."""
        return self.client.state if self.client is not None else {}

    def next_lr(self) -> float:
        """hybrid's AdamW's rate for the step about to run: its group's ``lr``
        (unused with a client optimizer, whose groups hold their own)."""
        return float(self.param_groups[0]["lr"])

    def check_unchanged(self) -> None:
        """ConfigError naming the first hyperparameter other than ``lr`` the caller wrote
        into hybrid's AdamW's group (it takes them from the config)."""
        for i, (g, w) in enumerate(zip(self.param_groups, self._fixed)):
            for k, v in w.items():
                if g.get(k) != v:
                    raise ConfigError(
                        f"engine.optimizer.param_groups[{i}][{k!r}] was set to {g.get(k)!r} "
                        f"(the engine's is {v!r}): hybrid's AdamW takes {k} from the config; "
                        f"set the ds_config's \"optimizer\" params, or pass a torch "
                        f"optimizer as initialize(optimizer=...) to change it while training")

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale the next step uses (1.0 without fp16)."""
        return float(self._zero.scaler.scale)

    cur_scale = loss_scale  # DeepSpeed's fp16 optimizers' name for it

    def zero_grad(self, set_to_none: bool = True) -> None:
        """engine.zero_grad() (backward clears the gradients at each window's start)."""
        self._zero.zero_grad()

    def step(self, closure: Callable[[], float] | None = None) -> None:
        raise ConfigError("engine.optimizer.step(): hybrid's engine steps its optimizer in "
                          "engine.step() (at the accumulation boundary); call engine.step()")

    def state_dict(self) -> dict:
        raise ConfigError("engine.optimizer.state_dict(): hybrid's optimizer state is sharded "
                          "over the ranks; save it with engine.save_checkpoint(dir)")

    def load_state_dict(self, state: dict) -> None:
        raise ConfigError("engine.optimizer.load_state_dict(): hybrid's optimizer state is "
                          "sharded over the ranks; load it with engine.load_checkpoint(dir)")


def dataloader_of(dataset: Dataset, ps: ParallelState, batch_size: int,
                  collate_fn: Callable[[list[Any]], Any] | None = None,
                  drop_last: bool = False, workers: int = 0) -> DataLoader:
    """DeepSpeed's training loader: this DP rank's share of ``dataset`` through a
    ``DistributedSampler`` (shuffled with its seed 0, the same order every epoch, as
    DeepSpeed's loader, which sets no epoch), ``batch_size`` samples a batch."""
    from torch.utils.data import DataLoader, DistributedSampler
    sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=ps.dp_size,
                                                     rank=ps.dp_rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, num_workers=workers,
                      pin_memory=ps.device.type == "cuda")
