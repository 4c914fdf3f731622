"""DeepSpeed's pipeline engine verbs over hybrid's pipeline: ``train_batch``, ``eval_batch``.

``deepspeed.initialize(model=PipelineModule(...))`` returns a :class:`PipelineEngine`: the
engine of :mod:`hybrid.train.api` (ZeRO over this stage's DP group, the optimizer, the
schedule of rates, checkpoints) with DeepSpeed's pipeline verbs, each a whole optimizer
step or evaluation through :func:`hybrid.pipeline.executor.run_actions`.

[Note: one step of train_batch]
Each rank of a pipeline draws ``gradient_accumulation_steps()`` micro-batches from its
iterator, ``(inputs, labels)`` each: the first stage feeds the inputs to its layers, the
last gives its output and the labels to ``loss_fn`` (none: the output is the loss), a
middle stage reads no data (it has no iterator, as in DeepSpeed). The micro-batches run
under hybrid's checked 1F1B schedule (DeepSpeed's pipeline schedule is 1F1B too), each
loss divided by the micro-batch count (and times the fp16 loss scale) before its
backward, so the accumulated gradient is the batch's mean; each stage's gradients reduce
over its DP group once a step ([Note: ZeRO under a schedule] in the executor), a tied
weight's copies sum over the first and the last stage, and the optimizer steps every
stage's shard. ``train_batch`` returns what DeepSpeed's does: the mean of the last
stage's micro-batch losses, averaged over DP, on every rank (a DP all-reduce on the last
stage, then an all-reduce over the pipeline group, the other stages adding zeros).
The shapes between stages are learnt on the first step (:mod:`hybrid.pipeline.wire`),
separately for training and evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NoReturn

import torch

from hybrid.errors import ConfigError
from hybrid.pipeline.executor import run_actions
from hybrid.pipeline.schedules import forward_only
from hybrid.pipeline.wire import Learnt
from hybrid.train.api import Engine
from hybrid.train.pipeline_step import checked_schedule
from hybrid.zero.loss_scaler import scaled_loss

SCHEDULE = "1f1b"  # DeepSpeed's TrainSchedule is 1F1B


class RepeatingLoader:
    """A loader that starts again at its end (DeepSpeed's ``RepeatingLoader``): what the
    engine draws ``train_batch``'s micro-batches from when given ``training_data``."""

    def __init__(self, loader):
        self.loader, self._it = loader, iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


def _to(x, device: torch.device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return tuple(_to(t, device) for t in x)
    return x


class PipelineEngine(Engine):
    """The engine of a :class:`~hybrid.deepspeed.pipe.PipelineModule` (module doc). The
    per-micro-batch verbs (``forward``, ``backward``, ``step``) are refused, as in
    DeepSpeed: one ``train_batch`` is forward, backward and step of a whole batch."""

    data_iterator: Iterator | None = None
    _learnt_train: Learnt
    _learnt_eval: Learnt

    def _arm(self) -> None:
        # (train_batch clears the gradients and brackets each backward itself)
        self._learnt_train, self._learnt_eval = Learnt(), Learnt()

    # -- DeepSpeed's pipeline queries -------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.ps.pp_size

    @property
    def stage_id(self) -> int:
        return self.ps.pp_rank

    @property
    def micro_batches(self) -> int:
        return self.gradient_accumulation_steps()

    def is_first_stage(self) -> bool:
        return self.ps.is_first_stage

    def is_last_stage(self) -> bool:
        return self.ps.is_last_stage

    def get_pipeline_parallel_rank(self) -> int:
        return self.ps.pp_rank

    def _reads_data(self) -> bool:
        return self.is_first_stage() or self.is_last_stage()

    def set_dataloader(self, loader) -> None:
        """Draw ``train_batch``'s micro-batches from ``loader`` (first and last stage)."""
        if self._reads_data():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator) -> None:
        """Draw ``train_batch``'s micro-batches from ``iterator`` (first and last stage)."""
        if self._reads_data():
            self.training_dataloader = None
            self.data_iterator = iterator

    # -- the refused per-micro-batch verbs ------------------------------------------------
    def _whole_batch(self, verb: str) -> NoReturn:
        raise ConfigError(f"engine.{verb}() with a PipelineModule: a pipeline runs whole "
                          f"batches; call engine.train_batch() (or eval_batch(data_iter))")

    def forward(self, *args, **kwargs):
        self._whole_batch("forward")

    def backward(self, *args, **kwargs) -> torch.Tensor:
        self._whole_batch("backward")

    def step(self, *args, **kwargs) -> None:
        self._whole_batch("step")

    # -- the verbs -----------------------------------------------------------------------
    def _draw(self, data_iter, n: int, verb: str) -> list:
        """``n`` micro-batches from ``data_iter`` on the first and last stage; Nones on a
        middle stage (it reads no data)."""
        if not self._reads_data():
            return [None] * n
        if data_iter is None:
            raise ConfigError(f"engine.{verb}(): no data: pass data_iter=, or "
                              f"training_data= to deepspeed.initialize")
        out = []
        for _ in range(n):
            batch = next(data_iter)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ConfigError(f"engine.{verb}(): each batch must be (inputs, labels), "
                                  f"got {type(batch).__name__}"
                                  + (f" of {len(batch)}" if hasattr(batch, "__len__") else ""))
            out.append((_to(batch[0], self.device), _to(batch[1], self.device)))
        return out

    def _run(self, batches: list, n: int, train: bool, compute_loss: bool = True):
        """The micro-batches through the pipeline; the last stage's per-micro-batch
        losses as computed (before any division), by micro-batch."""
        module, p = self.module, self.ps.pp_size
        loss_fn = getattr(module, "loss_fn", None)
        scale = self.zero.scaler.scale if train else 1.0
        outputs: dict[int, object] = {}

        def forward(stage: int, j: int, x):
            out = module(batches[j][0] if x is None else x)
            if stage < p - 1:
                return out
            loss = out
            if compute_loss and loss_fn is not None:
                loss = loss_fn(out, batches[j][1])
            if not train:
                outputs[j] = out
                return loss
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigError("train_batch(): the last stage's loss must be one scalar "
                                  "tensor (loss_fn(output, labels), or the output itself)")
            return scaled_loss(loss, scale) / n  # (in fp32 under fp16: no overflow of its own)

        if train:
            lists = checked_schedule(SCHEDULE, p, n)
            params = {self.ps.pp_rank: [q for q in module.parameters() if q.requires_grad]}
            got = run_actions(lists.ranks[self.ps.pp_rank], forward, params, self.ps.pp_group,
                              shape=None, dtype=torch.float32, device=self.device, stages=p,
                              zero=self.zero, peers=lists.ranks, learnt=self._learnt_train)
            return {j: loss.float() * (n / scale) for j, loss in got.items()}, outputs
        lists = forward_only(p, n)
        got = run_actions(lists.ranks[self.ps.pp_rank], forward, {}, self.ps.pp_group,
                          shape=None, dtype=torch.float32, device=self.device, stages=p,
                          peers=lists.ranks, learnt=self._learnt_eval)
        return got, outputs

    def _shared_mean(self, losses: dict[int, torch.Tensor], n: int) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, averaged over DP, on every
        rank of the pipeline ([Note: one step of train_batch])."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for loss in losses.values():
            total += loss.detach().float().sum()
        total /= n
        if self.is_last_stage():
            self.ps.dp_group.all_reduce(total)
            total /= self.ps.dp_size
        self.ps.pp_group.all_reduce(total)  # (the other stages add zeros)
        return total

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps()`` micro-batches from
        ``data_iter`` (kept for later calls; default: the iterator given before, or the
        loader over ``training_data``); returns the batch's mean loss, on every rank
        ([Note: one step of train_batch])."""
        if not torch.is_grad_enabled():
            raise ConfigError("engine.train_batch() under torch.no_grad(): it trains; "
                              "use engine.eval_batch(data_iter) to evaluate")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        n = self.gradient_accumulation_steps()
        self.module.train()
        batches = self._draw(self.data_iterator, n, "train_batch")
        self.optimizer.check_unchanged()
        self.zero.zero_grad()
        losses, _ = self._run(batches, n, train=True)
        mean = self._shared_mean(losses, n)
        # (the loss before the DP mean is this pipeline's: the step's non-finite check)
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for loss in losses.values():
            local += loss / n
        self.ps.pp_group.all_reduce(local)
        result = self.zero.step(self.optimizer.next_lr(), loss=local)
        self.last_result = result
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.micro_steps += n
        if self.lr_scheduler is not None and result.host_skipped is not True:
            self.lr_scheduler.step()  # (as Engine.step: unless fp16 skipped the step)
        return mean

    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None):
        """Forward only over ``num_micro_batches`` (default ``gradient_accumulation_steps()``)
        micro-batches of ``data_iter`` (the training iterator is kept): the mean loss,
        averaged over DP, on every rank (``reduce_output="avg"``, ``bcast_loss``);
        with ``return_logits``, also the last stage's outputs (a list by micro-batch;
        None elsewhere). Refused: ``reduce_output`` other than "avg", ``bcast_loss=False``."""
        if reduce_output != "avg" or not bcast_loss:
            raise ConfigError("engine.eval_batch(): hybrid reduces the outputs by their mean "
                              "and shares it with every stage; pass reduce_output=\"avg\", "
                              "bcast_loss=True")
        n = num_micro_batches or self.gradient_accumulation_steps()
        self.module.eval()
        try:
            batches = self._draw(data_iter, n, "eval_batch")
            losses, outputs = self._run(batches, n, train=False, compute_loss=compute_loss)
            mean = self._shared_mean(losses, n)
        finally:
            self.module.train()
        if return_logits:
            logits = [outputs[j] for j in sorted(outputs)] if self.is_last_stage() else None
            return mean, logits
        return mean
