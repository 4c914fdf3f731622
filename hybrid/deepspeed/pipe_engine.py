"""DeepSpeed's pipeline engine verbs over hybrid's pipeline: ``train_batch``, ``eval_batch``.

``deepspeed.initialize(model=PipelineModule(...))`` returns a :class:`PipelineEngine`: the
engine of :mod:`hybrid.engine.api` (ZeRO over this stage's DP group, the optimizer, the
schedule of rates, checkpoints) with DeepSpeed's pipeline verbs: ``train_batch`` is the
one training step every door runs (:func:`hybrid.pipeline.step.train_step`), given this
module's stages; ``eval_batch`` a forward-only schedule through
:func:`hybrid.pipeline.executor.run_actions`.

[Note: one step of train_batch]
Each rank of a pipeline draws ``gradient_accumulation_steps()`` micro-batches from its
iterator, ``(inputs, labels)`` each: the first stage feeds the inputs to its layers, the
last gives its output and the labels to ``loss_fn`` (none: the output is the loss), a
middle stage reads no data (it has no iterator, as in DeepSpeed). The micro-batches run
under hybrid's checked 1F1B schedule (DeepSpeed's pipeline schedule is 1F1B too), each
loss divided by the micro-batch count (and times the fp16 loss scale) before its
backward, so the accumulated gradient is the batch's mean ([Note: the loss path] in
hybrid/pipeline/step.py, the Trainer's own); each stage's gradients reduce
over its DP group once a step ([Note: ZeRO under a schedule] in the executor), a tied
weight's copies sum over the first and the last stage, and the optimizer steps every
stage's shard. ``train_batch`` returns what DeepSpeed's does: the mean of the last
stage's micro-batch losses, averaged over DP, on every rank (an all-reduce over the
pipeline group, the other stages adding zeros, then one over DP).
The shapes between stages are learnt on the first step (:mod:`hybrid.pipeline.wire`),
separately for training and evaluation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

import torch

from hybrid.engine.api import Engine
from hybrid.errors import ConfigError
from hybrid.pipeline.executor import Forward, run_actions
from hybrid.pipeline.schedules import forward_only
from hybrid.pipeline.step import checked_schedule, train_step
from hybrid.pipeline.wire import Activation, Learnt

SCHEDULE = "1f1b"  # DeepSpeed's TrainSchedule is 1F1B


class RepeatingLoader:
    """A loader that starts again at its end (DeepSpeed's ``RepeatingLoader``): what the
    engine draws ``train_batch``'s micro-batches from when given ``training_data``."""

    def __init__(self, loader: Iterable[Any]):
        self.loader, self._it = loader, iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


def _to(x: object, device: torch.device) -> object:
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
    # DeepSpeed's clip norm under its pipeline: its clip_grad_norm_ counts a parameter that
    # is not tensor-split on model-parallel rank 0 only, and the pipeline grid makes every
    # stage of a replica one model-parallel group, so the norm is the first stage's (plus
    # the split parameters of all) and every stage clips by it (AdamWConfig.clip_norm_of)
    clip_norm_of = "first_stage"
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

    def set_dataloader(self, loader: Iterable[Any]) -> None:
        """Draw ``train_batch``'s micro-batches from ``loader`` (first and last stage)."""
        if self._reads_data():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """Draw ``train_batch``'s micro-batches from ``iterator`` (first and last stage)."""
        if self._reads_data():
            self.training_dataloader = None
            self.data_iterator = iterator

    # -- the refused per-micro-batch verbs ------------------------------------------------
    def _whole_batch(self, verb: str) -> NoReturn:
        raise ConfigError(f"engine.{verb}() with a PipelineModule: a pipeline runs whole "
                          f"batches; call engine.train_batch() (or eval_batch(data_iter))")

    def forward(self, *args: object, **kwargs: object) -> NoReturn:
        self._whole_batch("forward")

    def backward(self, *args: object, **kwargs: object) -> torch.Tensor:
        self._whole_batch("backward")

    def step(self, *args: object, **kwargs: object) -> None:
        self._whole_batch("step")

    # -- the verbs -----------------------------------------------------------------------
    def _draw(self, data_iter: Iterator[Any] | None, n: int, verb: str) -> list:
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

    def _forward(self, batches: list, train: bool, compute_loss: bool = True,
                 outputs: dict[int, object] | None = None) -> Forward:
        """The stages' forward (hybrid/pipeline/executor.py's ``forward``): the module's
        layers of this stage; on the last stage ``loss_fn(output, labels)`` (or the output,
        without a ``loss_fn``), its outputs kept in ``outputs`` when evaluating."""
        module, p = self.module, self.ps.pp_size
        loss_fn = getattr(module, "loss_fn", None)

        def forward(stage: int, j: int, x: Activation | None) -> Activation:
            out = module(batches[j][0] if x is None else x)
            if stage < p - 1:
                return out
            loss = loss_fn(out, batches[j][1]) if compute_loss and loss_fn is not None else out
            if outputs is not None:
                outputs[j] = out
            if train and not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise ConfigError("train_batch(): the last stage's loss must be one scalar "
                                  "tensor (loss_fn(output, labels), or the output itself)")
            return loss
        return forward

    def _dp_mean(self, total: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (the same on every stage of the pipeline), averaged over
        DP ([Note: one step of train_batch])."""
        mean = total.detach().float().clone()
        self.ps.dp_group.all_reduce(mean)
        return mean / self.ps.dp_size

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps()`` micro-batches from
        ``data_iter`` (kept for later calls; default: the iterator given before, or the
        loader over ``training_data``); returns the batch's mean loss, on every rank
        ([Note: one step of train_batch])."""
        if not torch.is_grad_enabled():
            raise ConfigError("engine.train_batch() under torch.no_grad(): it trains; "
                              "use engine.eval_batch(data_iter) to evaluate")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.progress.batch_started()  # (the time the steps_per_print line reports)
        n = self.gradient_accumulation_steps()
        self.module.train()
        batches = self._draw(self.data_iterator, n, "train_batch")
        self.optimizer.check_unchanged()
        p = self.ps.pp_size
        params = {self.ps.pp_rank: [q for q in self.module.parameters() if q.requires_grad]}
        total, result, _ = train_step(self._forward(batches, train=True),
                                      checked_schedule(SCHEDULE, p, n), self.zero,
                                      self.optimizer.next_lr(), self.ps.pp_group, shape=None,
                                      dtype=torch.float32, device=self.device, params=params,
                                      learnt=self._learnt_train)
        self._stepped(result, n)
        mean = self._dp_mean(total)
        self.progress.batch_ended(mean)  # DeepSpeed's "steps: N loss: ..." line, when due
        return mean

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: str | None = "avg",
                   bcast_loss: bool = True, num_micro_batches: int | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, list[object] | None]:
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
        p = self.ps.pp_size
        self.module.eval()
        outputs: dict[int, object] = {}
        try:
            batches = self._draw(data_iter, n, "eval_batch")
            lists = forward_only(p, n)
            got = run_actions(lists.ranks[self.ps.pp_rank],
                              self._forward(batches, False, compute_loss, outputs), {},
                              self.ps.pp_group, shape=None, dtype=torch.float32,
                              device=self.device, stages=p, peers=lists.ranks,
                              learnt=self._learnt_eval)
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            for j in sorted(got):
                total += got[j].detach().float().sum()
            self.ps.pp_group.all_reduce(total)  # (the other stages add zeros)
            mean = self._dp_mean(total / n)
        finally:
            self.module.train()
        if return_logits:
            logits = [outputs[j] for j in sorted(outputs)] if self.is_last_stage() else None
            return mean, logits
        return mean
