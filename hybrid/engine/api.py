"""The engine ``hybrid.initialize`` returns (:mod:`hybrid.engine.build` builds it): ZeRO for
any ``nn.Module``, with DeepSpeed's verbs.

    engine, optimizer, _, lr_scheduler = hybrid.initialize(model=model, config="ds_config.json")
    for batch in data:
        loss = engine(**batch).loss
        engine.backward(loss)      # scaled for fp16, divided by the accumulation steps
        engine.step()              # at the accumulation boundary: AdamW on the shard + LR
    engine.save_checkpoint("ckpt", client_state={"epoch": 3})

The engine is the one ``pretrain_gpt.py`` trains with (:func:`hybrid.zero.apply_zero`,
its loss scaler, offload tiers and checkpoint format), configured from a ds_config (a
path or a dict, :mod:`hybrid.config.deepspeed`) on top of the defaults of hybrid's flags.
Process groups come from torchrun's environment (gloo on a CPU, NCCL on a GPU), or from a
:class:`ParallelState` passed in. DeepSpeed's progress line: :mod:`hybrid.engine.progress`.
``import hybrid.deepspeed as deepspeed`` (:mod:`hybrid.deepspeed`) is the same
engine behind DeepSpeed's module layout.

[Note: micro-steps and steps]
As in DeepSpeed, ``backward`` and ``step`` are called every micro-batch; the
optimizer runs on the last of each ``gradient_accumulation_steps()``. Each
micro-batch's loss is divided by that count, so the accumulated gradient is
the mean over the global batch. ``micro_steps`` counts the ``step()`` calls,
so between a ``backward`` and its ``step`` ``is_gradient_accumulation_boundary()``
says whether this micro-batch's step is an optimizer step. The learning rate is
hybrid's schedule (the ds_config's ``scheduler`` block or the ``--lr*`` defaults)
at the step about to run; ``optimizer.param_groups[i]["lr"]`` and ``get_lr()``
hold the rate of the next optimizer step, as DeepSpeed's do.

[Note: the user's RNG]
``initialize`` leaves torch's global generators (the CPU one, and the device's) as it
found them: hybrid's streams (the TP tracker, a ``zero_init`` model's draws) come from their
own seeds, and what must seed the global generator to make them runs inside
``torch.random.fork_rng``. The user's seed goes on deciding their shuffles and dropout masks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybrid.checkpoint.api_state import SaveClaims
from hybrid.checkpoint.async_save import AsyncSaver
from hybrid.checkpoint.snapshot import snapshot_for
from hybrid.config import TrainConfig
from hybrid.engine.progress import Progress
from hybrid.engine.surface import EngineOptimizer, dataloader_of
from hybrid.errors import ConfigError
from hybrid.parallel.state import ParallelState
from hybrid.pipeline.step import micro_batch_loss
from hybrid.tensor_parallel.random import TPRNGTracker
from hybrid.zero import StepResult, ZeroEngine
from hybrid.zero.loss_scaler import scaled_loss

if TYPE_CHECKING:
    from torch.utils.data import Dataset, Sampler

log = logging.getLogger("hybrid")


def _tensors(out: object) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output: a tensor, or one inside tuples, lists and
    dicts (a transformers ModelOutput is a dict)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, Mapping):
        for o in out.values():
            yield from _tensors(o)


_NOT_YET = {  # DeepSpeed engine methods hybrid's engine does not have yet: name -> instead
    "set_train_batch_size": "the batch sizes are fixed by the config",
    "set_gradient_accumulation_boundary": "the boundary follows gradient_accumulation_steps",
    "load_universal_checkpoint": "hybrid's checkpoints reshard themselves: load_checkpoint",
    "get_data_parallel_group": "the groups live in engine.ps (a hybrid ParallelState)",
    "empty_partition_cache": "stage 3 frees gathered parameters after each module",
}


class Engine:
    """DeepSpeed's engine verbs and the attributes its scripts read, over one
    :class:`~hybrid.zero.ZeroEngine` (module notes). An attribute the engine does not
    have is looked up on the wrapped module, as DeepSpeed's engine does."""

    progress: Progress  # DeepSpeed's steps_per_print lines (initialize makes it)
    save_claims: SaveClaims  # its save directories (api_state's Note on owners; initialize)
    # the client optimizer's groups by parameter name (None: hybrid's AdamW, one group),
    # which checkpoints record: the DeepSpeed export rebuilds the groups from them
    group_members: list[list[str]] | None = None
    clip_norm_of = "model"  # the gradients the clip's norm counts (AdamWConfig.clip_norm_of)
    get_mom = property(lambda self: self.progress.get_mom)  # betas (SGD: momentum) by group
    skipped_steps = property(lambda self: self.progress.skipped)  # (fp16's skipped steps)

    def __init__(self, module: nn.Module, cfg: TrainConfig, ps: ParallelState,
                 zero: ZeroEngine, rng: TPRNGTracker, optimizer: EngineOptimizer,
                 schedule: Any, dataloader: Iterable[Any] | None = None):
        self.module, self.cfg, self.ps, self.zero = module, cfg, ps, zero
        self.rng, self.optimizer, self.lr_scheduler = rng, optimizer, schedule
        self.training_dataloader = dataloader
        self.micro_steps = self.global_steps = self.global_samples = 0
        self._loss: torch.Tensor | None = None  # this window's summed micro-batch losses (device)
        self._backward_done = False  # an engine.backward since the last step() call
        self._plain = False  # a plain loss.backward() reached the outputs since then
        self._in_backward = False  # inside engine.backward
        self._window: str | None = None  # how this window's backwards ran: "engine", "plain"
        self._user_scaled = False  # engine.scale(loss) was called in this window
        self.last_result: StepResult | None = None  # of the last optimizer step
        # checkpoint.writer.decoupled (--async-save): the save in flight, published from
        # the steps (hybrid/checkpoint/async_save.py)
        self.saver = (AsyncSaver(ps, snapshot_for(zero)) if cfg.checkpoint.async_save
                      else None)
        self._arm()

    # -- what scripts read (DeepSpeed's names and types) --------------------------------
    @property
    def device(self) -> torch.device:
        return self.ps.device

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's LOCAL_RANK; the device index on
        a GPU without it)."""
        if "LOCAL_RANK" in os.environ:
            return int(os.environ["LOCAL_RANK"])
        return (self.ps.device.index or 0) if self.ps.device.type == "cuda" else 0

    @property
    def global_rank(self) -> int:
        return self.ps.rank

    @property
    def world_size(self) -> int:
        return self.ps.world_size

    @property
    def dp_world_size(self) -> int:
        return self.ps.dp_size

    @property
    def mp_world_size(self) -> int:
        return self.ps.tp_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.cfg.loop.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.cfg.num_micro_batches

    def train_batch_size(self) -> int:
        return self.cfg.loop.global_batch_size

    def zero_optimization_stage(self) -> int:
        return self.cfg.zero.stage

    def fp16_enabled(self) -> bool:
        return self.cfg.precision.params_dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.cfg.precision.params_dtype == "bf16"

    def gradient_clipping(self) -> float:
        return float(self.cfg.adamw.clip_grad)

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step, before clipping (None before the
        first step). A host read: call it where you log."""
        return None if self.last_result is None else float(self.last_result.grad_norm)

    def was_step_applied(self) -> bool:
        """False before the first optimizer step and after one skipped (a non-finite
        gradient or loss; fp16 overflow). A host read."""
        if self.last_result is None:
            return False
        skipped = self.last_result.host_skipped
        return not (bool(self.last_result.skipped) if skipped is None else skipped)

    def get_lr(self) -> list[float]:
        """The rate of the next optimizer step, per parameter group (DeepSpeed's)."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "module":  # (reached for names the engine lacks)
            raise AttributeError(name)
        if name in _NOT_YET:
            raise AttributeError(f"hybrid's engine has no {name} yet (DeepSpeed's "
                                 f"engine.{name}): {_NOT_YET[name]}")
        module = self.__dict__.get("module")
        if module is not None and hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"{type(self).__name__!r} object (hybrid's engine) has no "
                             f"attribute {name!r}, nor has its module "
                             f"{type(module).__name__}")

    # -- the training verbs ------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; its outputs tell the engine when a plain
        ``loss.backward()`` reaches them ([Note: plain backward])."""
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._reached)
        return out

    def _reached(self, grad: torch.Tensor) -> None:
        if not self._in_backward:
            self._plain = True

    # [Note: plain backward]
    # DeepSpeed's scripts may call loss.backward() and then engine.step(). The engine is
    # ready for either before each micro-batch (_arm: a new window clears the gradients,
    # and the reducer knows whether this micro-batch ends the window), so the
    # reductions run from the same hooks; a hook on each forward output says a plain
    # backward went through, and step() finishes it (the deferred reductions, stage 3's
    # gathers). Such a backward is of the undivided loss, so the window's gradient is
    # divided by the micro-batch count at the step (in the clip coefficient): the same
    # update as engine.backward's. fp16 needs the loss scaled: engine.scale(loss)
    # .backward(), as in DeepSpeed; without it the step raises. A window is one kind.

    # [Note: two backwards, one step] Each engine.backward at the boundary reduces what
    # it adds: at stages 2-3 a reduce-scatter adds into the shard the last one filled; at
    # stage 0 the buffer holds the last mean plus this rank's new gradient, and their mean
    # over DP is the last mean plus the new gradients' mean; stage 1 reduce-scatters the
    # same sum into its shard once GradReducer.rearm has put the shard back as a sum to
    # reduce. So two backwards before one step apply both gradients' DP means, whatever
    # the stage (tests/hybrid_deepspeed/cases/usage.py, two_backwards_*).

    def _arm(self) -> None:
        """Ready the micro-batch about to run ([Note: plain backward])."""
        if self.micro_steps % self.gradient_accumulation_steps() == 0:
            self.zero.zero_grad()
            self._loss, self._window, self._user_scaled = None, None, False
        self.zero.begin_backward(sync=self.is_gradient_accumulation_boundary())

    def _window_is(self, kind: str) -> None:
        if self._window not in (None, kind):
            raise ConfigError("one accumulation window mixed engine.backward(loss) and a plain "
                              "loss.backward(): use one of them for every micro-batch")
        self._window = kind

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, for a plain ``.backward()`` (DeepSpeed's
        engine.scale); the accumulation division still happens at the step."""
        self._user_scaled = True
        return scaled_loss(loss, self.zero.scaler.scale)

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def zero_grad(self) -> None:
        """(``backward`` clears the gradients at the start of each window itself.)"""
        self.zero.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch being run (its ``backward`` done, its ``step`` not yet)
        ends an accumulation window."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of this micro-batch's ``loss`` (divided by the accumulation steps
        unless ``scale_wrt_gas`` is False; gradients reduce over DP in the last
        micro-batch of the window). Returns the loss as it was backpropagated."""
        if retain_graph:
            raise ConfigError("engine.backward(loss, retain_graph=True): hybrid's engine "
                              "frees the graph in backward; compute the loss again instead")
        if self._plain:
            raise ConfigError("engine.backward() after a plain loss.backward() without "
                              "engine.step(): use one of them for every micro-batch")
        # A second engine.backward before step() (DeepSpeedExamples' GAN) adds its
        # gradient, as DeepSpeed's does: at the boundary each backward reduces, and a
        # reduction adds into what the last one left ([Note: two backwards, one step])
        if self._backward_done and self.cfg.offload.optimizer is not None:
            raise ConfigError("a second engine.backward() before engine.step() with the "
                              "optimizer offloaded (zero_optimization.offload_optimizer): "
                              "not in hybrid yet, the host step takes each gradient as its "
                              "reduction ends; call engine.step() between them, or keep "
                              "the optimizer on the device")
        self._window_is("engine")
        n = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        # the Trainer's loss path (hybrid/pipeline/step.py, [Note: the loss path])
        divided, backpropagated = micro_batch_loss(loss, n, self.zero.scaler.scale)
        self._in_backward = True
        try:
            if self._backward_done and self.is_gradient_accumulation_boundary():
                self.zero.reducer.rearm()  # (the last backward reduced: [Note: two ...])
            self.zero.begin_backward(sync=self.is_gradient_accumulation_boundary())
            backpropagated.backward()
            self.zero.end_backward()
        finally:
            self._in_backward = False
        recorded = divided.detach().float()
        self._loss = recorded if self._loss is None else self._loss + recorded
        self._backward_done = True
        return divided

    def step(self, lr_kwargs: Mapping[str, object] | None = None) -> None:
        """At an accumulation boundary: the optimizer step on this rank's shard (clip,
        skip on a non-finite gradient, all-gather), then the schedule; else nothing but
        the count. Each call follows a backward: ``engine.backward(loss)``, or a plain
        ``loss.backward()`` of a loss computed from the engine's outputs ([Note: plain
        backward])."""
        if lr_kwargs:
            raise ConfigError("engine.step(lr_kwargs=...): hybrid's schedule takes no "
                              "arguments; configure the ds_config's \"scheduler\" block")
        if self._plain:
            self._window_is("plain")
            if self.zero.scaler.scale != 1.0 and not self._user_scaled:
                raise ConfigError("a plain loss.backward() under fp16: the loss must be "
                                  "scaled first; call engine.scale(loss).backward() or "
                                  "engine.backward(loss)")
            self.zero.end_backward()
        elif not self._backward_done:
            raise ConfigError(
                "engine.step() without a backward since the last step: call "
                "engine.backward(loss), or loss.backward() of a loss computed from the "
                "engine's outputs (engine(...), not engine.module(...)), before engine.step()")
        self._backward_done = self._plain = False
        if self.is_gradient_accumulation_boundary():
            self.optimizer.check_unchanged()
            divisor = self.gradient_accumulation_steps() if self._window == "plain" else 1
            lr = self.optimizer.next_lr()
            self.zero.prefetch_step(lr, divisor)  # (an offloaded optimizer reads ahead)
            self._stepped(self.zero.step(lr, loss=self._loss, grad_divisor=divisor), 0)
        self.micro_steps += 1
        self._arm()

    def _stepped(self, result: StepResult, micro_batches: int) -> None:
        """The counts after an optimizer step of ``micro_batches`` micro-batches (0: counted
        by each ``step()`` call), and the schedule: as DeepSpeed's engine, it advances unless
        fp16 skipped the step (known on the host there; a bf16/fp32 skip is not, and
        DeepSpeed's schedule advances through it too)."""
        self.last_result = result
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.micro_steps += micro_batches
        if self.lr_scheduler is not None and result.host_skipped is not True:
            self.lr_scheduler.step()
        self.progress.stepped(result)  # DeepSpeed's steps_per_print line
        if self.saver is not None:  # (every rank steps here together: a collective poll)
            published = self.saver.poll()
            if published is not None:
                log.info("saved checkpoint %s (written in the background; published at "
                         "step %d)", published, self.global_steps)

    # -- data ----------------------------------------------------------------------------
    def deepspeed_io(self, dataset: Dataset, batch_size: int | None = None,
                     route: str | None = None, pin_memory: bool = True,
                     data_sampler: Sampler | None = None,
                     collate_fn: Callable[[list[Any]], Any] | None = None,
                     num_local_io_workers: int | None = None) -> Iterable[Any]:
        """A DataLoader over this DP rank's share of ``dataset`` (see :func:`dataloader_of`)."""
        if data_sampler is not None:
            raise ConfigError("engine.deepspeed_io(data_sampler=...): hybrid shards the data "
                              "with its own DistributedSampler; pass data_sampler=None")
        return dataloader_of(dataset, self.ps, batch_size or self.train_micro_batch_size_per_gpu(),
                             collate_fn, drop_last=False, workers=num_local_io_workers or 0)

    # -- checkpoints (hybrid's format: atomic, reshardable) ---------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None,
                        client_state: Mapping | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        *, overwrite: bool = False) -> str:
        """Collective: write step ``global_steps`` under ``save_dir``, as
        ``iter_NNNNNNN`` (hybrid's name) or, with a ``tag``, as ``save_dir/<tag>``;
        ``latest`` names it unless ``save_latest`` is False. ``client_state``: a dict
        of any values torch's safe loader takes back (tensors, numbers, strings,
        containers, ``argparse.Namespace``, numpy values; more with
        ``hybrid.checkpoint.allow_client_state_types``), rank 0's written beside the
        metadata as ``client_state.pt`` and returned by :meth:`load_checkpoint`; one
        it would not take back is a ValueError naming the value and its type, before
        anything is written. ``save_dir`` is claimed as ``--save`` is (api_state's Note on
        owners; ``overwrite=True`` deletes another run's checkpoints there). Returns the
        directory written. With ``checkpoint.writer.decoupled`` (DeepSpeed's decoupled
        writer; hybrid's ``--async-save``) the files are written on a thread: the
        directory appears, with ``latest`` naming it, at a later ``step()`` once every
        rank has written, at the next save or load, or at :meth:`close`. The module's
        frozen parameters and buffers are saved too (``module_state.pt``); with
        ``exclude_frozen_parameters`` the buffers only, and a load keeps the module's
        own frozen values."""
        from hybrid.checkpoint.api_state import save_engine
        return save_engine(self, save_dir, tag, dict(client_state or {}), save_latest,
                           overwrite, self.saver, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable[..., object] | None = None
                        ) -> tuple[str | None, dict | None]:
        """Collective: restore the checkpoint ``latest`` names under ``load_dir`` (or the
        one of ``tag``); returns (its path, the client_state saved with it, on every
        rank, its tensors on the CPU), or (None, None) when ``load_dir`` is missing or
        holds no checkpoint (the auto-resume idiom)."""
        from hybrid.checkpoint.api_state import load_engine
        if custom_load_fn is not None:
            raise ConfigError("load_checkpoint(custom_load_fn=...): hybrid loads its own "
                              "format; pass None")
        if self.saver is not None:
            self.saver.wait()  # (a load of the save in flight finds it published)
        got = load_engine(self, load_dir, tag, load_optimizer_states and not load_module_only,
                          load_lr_scheduler_states and not load_module_only)
        self._arm()  # (the counters moved: the window the next micro-batch is in)
        return got

    @torch.no_grad()
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective (stage 3 gathers): the module's full state_dict in its training dtype,
        written by rank 0 to ``save_dir/save_filename`` with ``torch.save``."""
        if self.ps.tp_size > 1:
            raise ConfigError("save_16bit_model with tensor parallelism: each rank holds a "
                              "slice of the weights; save_checkpoint and convert it "
                              "(scripts/convert_checkpoint.py) instead")
        self.zero.wait_optimizer()
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        with self.zero.gathered():
            state = {k: v.detach().to("cpu", copy=True)
                     for k, v in self.module.state_dict().items()
                     if not (exclude_frozen_parameters and k in frozen)}
        if self.ps.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True

    def close(self) -> None:
        """Finish the update and the save in flight, delete any swap files, free the save
        directories."""
        if self.saver is not None:
            self.saver.wait()
        self.zero.close()
        self.save_claims.release()

    destroy = close  # DeepSpeed's name
