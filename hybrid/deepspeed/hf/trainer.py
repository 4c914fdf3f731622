"""transformers' ``Trainer`` with hybrid's ZeRO engine where DeepSpeed's would be.

With :class:`hybrid.deepspeed.hf.TrainingArguments` carrying ``deepspeed=``, the
Trainer's loop runs as it does under DeepSpeed, each DeepSpeed call answered by
hybrid's engine (:func:`hybrid.deepspeed.initialize`):

=================================  ==========================================================
the Trainer                        here
=================================  ==========================================================
building the engine                when ``train()`` starts: the config's remaining ``"auto"``
                                   values filled (:mod:`.auto`), then ``initialize`` as
                                   transformers' ``deepspeed_init`` calls DeepSpeed's: the
                                   trainable parameters; the ``"optimizer"`` block or the
                                   Trainer's own optimizer; the ``"scheduler"`` block or the
                                   Trainer's own schedule over that optimizer.
                                   ``trainer.model_wrapped`` and ``trainer.deepspeed`` are
                                   the engine, ``trainer.model`` the user's module
the data                           accelerate's loaders, as in any multi-process run (each
                                   rank ``per_device_train_batch_size`` samples a batch)
``training_step``                  the loss from ``compute_loss`` (scaled for the window as
                                   the Trainer scales it), ``engine.backward(loss,
                                   scale_wrt_gas=False)``, ``engine.step()``: the optimizer
                                   and the schedule step at the end of each window
clipping, the gradient norm        the engine clips at ``gradient_clipping``; the norm logged
                                   is ``engine.get_global_grad_norm()``
``optimizer.step()``,              nothing (:mod:`.stepped`): the engine stepped them; the
``lr_scheduler.step()``            rate logged is the next step's, as under DeepSpeed
``save_model``                     collective: the full weights gathered, rank 0's
                                   ``save_pretrained`` (loadable with ``from_pretrained``)
a checkpoint's optimizer state     ``engine.save_checkpoint(checkpoint-N)`` (hybrid's format)
``train(resume_from_checkpoint)``,  ``engine.load_checkpoint``
``load_best_model_at_end``
``evaluate``, ``predict``          the model called through the engine (ZeRO-3 gathers each
                                   unit); before ``train()`` the whole model as it was built
=================================  ==========================================================

Refused, one ConfigError each naming what to do: a second ``train()`` on one Trainer;
an epoch whose micro-batch count is not a multiple of ``gradient_accumulation_steps``
when the run reaches its end (the engine's windows are always whole); an
``"optimizer"`` block with ``Trainer(optimizers=...)``; a ds_config that disagrees
with TrainingArguments (:mod:`.auto`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader
from transformers.trainer_utils import has_length

from hybrid import deepspeed
from hybrid.deepspeed.hf import auto
from hybrid.deepspeed.hf.arguments import TrainingArguments
from hybrid.deepspeed.hf.stepped import EngineStepsOptimizer, EngineStepsSchedule
from hybrid.engine.api import Engine
from hybrid.engine.build import configure_kernels
from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState


class Trainer(transformers.Trainer):
    """transformers' Trainer; with :class:`hybrid.deepspeed.hf.TrainingArguments`
    carrying ``deepspeed=`` it trains on hybrid's engine (module docstring), else it is
    transformers' Trainer unchanged.

    ``parallel_state`` (keyword, hybrid's own): the :class:`ParallelState` the engine
    uses (None: the one of torchrun's job, joined when training starts).

    ``engine`` is the engine once ``train()`` has built it (None before).
    """

    def __init__(self, *args: Any, parallel_state: ParallelState | None = None, **kwargs: Any):
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(given, "deepspeed", None) and not isinstance(given, TrainingArguments):
            raise ConfigError("hybrid.deepspeed.hf.Trainer got transformers' own "
                              "TrainingArguments(deepspeed=...), which hands the config to "
                              "DeepSpeed; import TrainingArguments from hybrid.deepspeed.hf "
                              "too (from hybrid.deepspeed.hf import Trainer, "
                              "TrainingArguments)")
        self.engine: Engine | None = None
        self._parallel_state = parallel_state
        super().__init__(*args, **kwargs)

    @property
    def _on_hybrid(self) -> bool:
        return isinstance(self.args, TrainingArguments) and self.args.hybrid_ds_config is not None

    # -- building the engine -------------------------------------------------------------
    def _prepare_for_training(self, max_steps: int, train_dataloader: DataLoader,
                              resume_from_checkpoint: str | None
                              ) -> tuple[nn.Module | Engine, DataLoader]:
        if not self._on_hybrid:
            return super()._prepare_for_training(max_steps, train_dataloader,
                                                 resume_from_checkpoint)
        if self.engine is not None:
            raise ConfigError("Trainer.train() a second time: hybrid's engine is built once "
                              "per Trainer, from the model as it was (its parameters are "
                              "sharded now); build a new Trainer, or resume from a "
                              "checkpoint with train(resume_from_checkpoint=...)")
        self._check_windows(train_dataloader, max_steps)
        engine = self._build_engine(max_steps)
        self.engine = engine
        # where transformers keeps DeepSpeed's engine: scripts and callbacks read them
        self.model_wrapped = self.deepspeed = engine  # type: ignore[assignment]
        self._schedule = EngineStepsSchedule(engine)
        self.optimizer = EngineStepsOptimizer(engine)  # type: ignore[assignment]
        self.lr_scheduler = self._schedule  # type: ignore[assignment]
        if resume_from_checkpoint is not None:
            path, _ = engine.load_checkpoint(resume_from_checkpoint)
            if path is None:
                raise ConfigError(f"train(resume_from_checkpoint={resume_from_checkpoint!r}): "
                                  f"no hybrid checkpoint there (a Trainer checkpoint saved "
                                  f"through hybrid's engine holds one)")
        for name in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, name, getattr(self, name))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def _check_windows(self, dataloader: DataLoader, max_steps: int) -> None:
        """The engine steps every ``gradient_accumulation_steps`` micro-batches; the
        Trainer would close a shorter window at an epoch's end."""
        every = self.args.gradient_accumulation_steps
        if not has_length(dataloader):
            return
        n = len(dataloader)
        if n % every and max_steps > n // every:
            raise ConfigError(
                f"an epoch is {n} micro-batches per rank, not a multiple of "
                f"gradient_accumulation_steps {every}: the Trainer would step the optimizer "
                f"after a shorter last window, which hybrid's engine does not do yet; make "
                f"the epoch's batches a multiple (the data, per_device_train_batch_size, "
                f"dataloader_drop_last) or stop within the first epoch (max_steps <= "
                f"{n // every})")

    def _build_engine(self, max_steps: int) -> Engine:
        """The engine, built as transformers builds DeepSpeed's (``deepspeed_init``): the
        trainable parameters given; the config's ``"optimizer"`` block, else the
        Trainer's own optimizer (``create_optimizer()``: TrainingArguments.optim, its
        groups without decay of biases and norms); the config's ``"scheduler"`` block,
        else the Trainer's schedule (``lr_scheduler_type``) over that optimizer."""
        args = self.args
        assert isinstance(args, TrainingArguments)
        config, filler = args.hybrid_ds_config, args.hybrid_ds_filler
        assert config is not None and filler is not None
        model = self.model
        assert model is not None
        auto.fill_from_run(filler, args, model, max_steps)
        optimizer, schedule = None, None  # None: the config's block
        if "optimizer" in config:
            if self.optimizer is not None:
                raise ConfigError("Trainer(optimizers=(optimizer, ...)) and the ds_config's "
                                  "\"optimizer\" block: two optimizers; drop one")
        else:
            optimizer = self.create_optimizer()  # (the one optimizers= gave, if any)
        if "scheduler" not in config:
            # the one optimizers= gave, else the Trainer's, over the optimizer the engine steps
            schedule = self.lr_scheduler or (lambda built: self.create_scheduler(
                num_training_steps=max_steps, optimizer=built))
        # the Trainer is the script's entry point: HYBRID_* once, the cache it is told
        configure_kernels(os.environ, args.kernel_cache_dir)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer, lr_scheduler=schedule, config=config,
            mpu=self._parallel_state, seed=args.seed)
        return engine

    # -- one micro-batch -----------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The Trainer's micro-batch on the engine: ``compute_loss``, divided by the
        window's micro-batch count unless it is already normalized over the window (the
        Trainer's rule), then ``engine.backward(loss, scale_wrt_gas=False)`` and
        ``engine.step()``. Returns the loss as backpropagated, detached."""
        if not self._on_hybrid:
            return super().training_step(model, inputs, num_items_in_batch)
        engine = self.engine
        assert engine is not None
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs,  # type: ignore[arg-type]
                                     num_items_in_batch=num_items_in_batch)
        assert isinstance(loss, torch.Tensor)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:  # normalized by the window's item count, or by the user's function
            scaled = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                      or self.compute_loss_func is not None)
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor | float | None:
        if not self._on_hybrid:
            return super()._clip_grad_norm(model)
        assert self.engine is not None
        return self.engine.get_global_grad_norm()  # the engine clipped in engine.step()

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | float | None = None
                       ) -> torch.Tensor | float | None:
        if not self._on_hybrid:
            return super()._get_grad_norm(model, grad_norm)
        assert self.engine is not None
        return grad_norm if grad_norm is not None else self.engine.get_global_grad_norm()

    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: torch.utils.data.DataLoader | None = None) -> nn.Module:
        if self._on_hybrid and self.engine is not None:
            return self.engine  # type: ignore[return-value]
        return super()._wrap_model(model, training, dataloader)

    # -- saving and loading ----------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective once the engine is built (every rank calls it, as under DeepSpeed):
        the full weights in the training dtype, gathered from the shards, written by
        rank 0 with ``save_pretrained``."""
        if not self._on_hybrid or self.engine is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._save(output_dir, state_dict=gathered_state_dict(self.engine))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._on_hybrid or self.engine is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        # the optimizer state and the schedule are sharded or the engine's: its checkpoint
        self.engine.save_checkpoint(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        if not self._on_hybrid:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        # the engine's load_checkpoint restores the weights once the engine is built

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._on_hybrid:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        # restored with the weights by the engine's load_checkpoint

    def _load_best_model(self) -> None:
        if not self._on_hybrid or self.engine is None:
            super()._load_best_model()
            return
        best = self.state.best_model_checkpoint
        assert best is not None
        path, _ = self.engine.load_checkpoint(best)
        if path is None:
            raise ConfigError(f"load_best_model_at_end: no hybrid checkpoint in {best}")


@torch.no_grad()
def gathered_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """Collective: the module's full state_dict on the host, in its training dtype (ZeRO-3
    gathers each shard), on every rank."""
    engine.zero.wait_optimizer()  # the last step's update is in the weights
    with engine.zero.gathered():
        return {k: v.detach().to("cpu", copy=True)
                for k, v in engine.module.state_dict().items()}
