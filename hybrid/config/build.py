"""Flat Megatron flags -> one checked, nested :class:`TrainConfig`, in one place.

:func:`build_config` runs every check that can reject a run
(:mod:`hybrid.config.checks`; every message names the flag to change) and
returns frozen sections (:mod:`hybrid.config.sections`); each component takes
only its own. No torch import: the launcher checks a command line in a
fraction of a second before it starts any worker.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hybrid.config import checks
from hybrid.config.architecture import validate_architecture
from hybrid.config.deepspeed import apply_ds_config, load_ds_config
from hybrid.config.flags import Flags, flag_name
from hybrid.config.kernels import kernel_config_from_env, parse_kernel_choice
from hybrid.config.sections import (AdamWConfig, CheckpointConfig, DataConfig, DiagnosticsConfig,
                                    KernelConfig, LoggingConfig, LoopConfig, LRScheduleConfig,
                                    ModelConfig, OffloadConfig, ParallelConfig, PrecisionConfig,
                                    RecomputeConfig, TokenizerConfig, ZeroConfig)
from hybrid.errors import ConfigError
from hybrid.parallel.layout import check_layout

__all__ = ["TrainConfig", "build_config"]


@dataclass(frozen=True)
class TrainConfig:
    """One run's configuration: a frozen section per component, plus the run's seed.

    ``flags`` are the checked flat flags with derived defaults filled in: they go
    into checkpoint metadata and the start-up log, as Megatron users know them.
    """

    parallel: ParallelConfig
    model: ModelConfig
    lr_schedule: LRScheduleConfig
    loop: LoopConfig
    zero: ZeroConfig
    adamw: AdamWConfig
    precision: PrecisionConfig
    offload: OffloadConfig
    recompute: RecomputeConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    diagnostics: DiagnosticsConfig
    kernels: KernelConfig
    seed: int
    flags: Flags

    def to_dict(self) -> dict:
        """The flat flags (checkpoint metadata, logs)."""
        d = dataclasses.asdict(self.flags)
        for name in ("ignored_megatron_flags", "explicit_flags", "ds_config_notes", "given_as"):
            d.pop(name)
        return d

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank per step at the full global batch (after any ramp-up)."""
        s, p = self.loop, self.parallel
        return s.global_batch_size // (s.micro_batch_size * p.data_parallel_size)


def build_config(flags: Flags, world_size: int,
                 environ: Mapping[str, str] | None = None) -> TrainConfig:
    """Check ``flags`` for ``world_size`` ranks and cut them into sections.

    ``flags`` is not modified; the returned config's ``flags`` is a copy with
    the derived defaults filled in. ``environ``: the entry point's environment,
    whose ``HYBRID_*`` variables default the kernel flags and whose cache directory
    keeps the parsed built-in corpus (None: flags only).
    Every check runs first (:func:`_check`); then one small builder per section
    reads the checked flags (only ``_kernels`` writes back into them: the
    kernel flags it fills from ``environ``).
    """
    f = dataclasses.replace(flags)
    _deepspeed(f, world_size)
    dp = _check(f, world_size)
    return TrainConfig(
        parallel=_parallel(f, world_size, dp), model=_model(f), lr_schedule=_lr_schedule(f),
        loop=_loop(f), zero=_zero(f), adamw=_adamw(f), precision=_precision(f),
        offload=_offload(f), recompute=_recompute(f), data=_data(f, environ),
        tokenizer=_tokenizer(f), checkpoint=_checkpoint(f), logging=_logging(f),
        kernels=_kernels(f, environ),
        diagnostics=_diagnostics(f), seed=f.seed, flags=f)


def _deepspeed(f: Flags, world_size: int) -> None:
    """``--deepspeed_config FILE`` (or ``--deepspeed FILE``): its keys into ``f``
    (:mod:`hybrid.config.deepspeed`), before any check reads them."""
    path = f.deepspeed_config
    if f.deepspeed:
        if path is not None and path != f.deepspeed:
            raise ConfigError(f"--deepspeed {f.deepspeed} and --deepspeed_config {path} name "
                              f"two files: keep one")
        path = f.deepspeed
    if path is None:
        return
    dp = check_layout(world_size, f.tensor_model_parallel_size, f.context_parallel_size)
    f.ds_config_notes = apply_ds_config(f, load_ds_config(path), dp, source=path)


def _check(f: Flags, world_size: int) -> int:
    """Every check that can reject the run, in order; fills derived defaults into ``f``.
    Returns the data-parallel size. A message names a value by the name the user gave
    it (:func:`_as_given`)."""
    try:
        return _run_checks(f, world_size)
    except ConfigError as e:
        raise ConfigError(_as_given(str(e), f.given_as)) from None


def _as_given(message: str, given_as: Mapping[str, str]) -> str:
    """``message`` with each flag whose value came from elsewhere (a ds_config key, an
    argument of ``hybrid.initialize``) named as the user gave it: "--zero-stage must be
    0, 1, 2 or 3, got 5" from ``{"zero_optimization": {"stage": 5}}`` says
    "ds_config zero_optimization.stage must be ...". The checks speak in flags; this is
    the one place that knows where a value came from."""
    for field, name in given_as.items():
        message = re.sub(rf"(?<![\w-]){re.escape(flag_name(field))}(?![\w-])",
                         lambda _, name=name: name, message)
    return message


def _run_checks(f: Flags, world_size: int) -> int:
    dp = check_layout(world_size, f.tensor_model_parallel_size, f.context_parallel_size)
    checks.check_numbers(f)
    checks.check_parallel(f)
    checks.check_model(f)
    validate_architecture(f)  # the Llama-family flags; fills the SwiGLU width
    checks.check_batch(f, dp)
    checks.check_schedule(f)
    checks.check_zero(f)
    checks.check_recompute(f)
    checks.check_data(f)
    checks.check_data_paths(f)
    checks.check_checkpoint(f)
    checks.check_output_dirs(f)
    return dp


# -- one builder per section, in TrainConfig's order ------------------------------------
def _parallel(f: Flags, world_size: int, dp: int) -> ParallelConfig:
    return ParallelConfig(
        world_size=world_size, tensor_model_parallel_size=f.tensor_model_parallel_size,
        data_parallel_size=dp, sequence_parallel=f.sequence_parallel,
        context_parallel_size=f.context_parallel_size, cp_comm_type=f.cp_comm_type,
        cp_layout=f.cp_layout, backend=f.distributed_backend, timeout_minutes=f.distributed_timeout_minutes)


def _model(f: Flags) -> ModelConfig:
    return ModelConfig.from_flags(f)


def _lr_schedule(f: Flags) -> LRScheduleConfig:
    """Warmup and decay in the unit the run is measured in (samples with
    ``--train-samples``, else iterations); ``--lr-warmup-fraction`` of the decay wins."""
    samples = f.train_samples is not None
    decay = f.lr_decay_samples if samples else f.lr_decay_iters
    warmup = f.lr_warmup_samples if samples else f.lr_warmup_iters
    if f.lr_warmup_fraction is not None:
        warmup = int(f.lr_warmup_fraction * decay)
    return LRScheduleConfig(lr=f.lr, min_lr=f.min_lr, decay_style=f.lr_decay_style,
                            unit="samples" if samples else "iterations",
                            warmup=warmup, decay=decay, warmup_init=f.lr_warmup_init,
                            warmup_style=f.lr_warmup_style)


def _loop(f: Flags) -> LoopConfig:
    return LoopConfig(
        micro_batch_size=f.micro_batch_size, global_batch_size=f.global_batch_size,
        rampup=tuple(f.rampup_batch_size) if f.rampup_batch_size else None,
        train_iters=f.train_iters, train_samples=f.train_samples,
        exit_interval=f.exit_interval, exit_duration_in_mins=f.exit_duration_in_mins,
        exit_signal_handler=f.exit_signal_handler,
        exit_on_nan_iterations=f.exit_on_nan_iterations, eval_interval=f.eval_interval,
        eval_iters=f.eval_iters)


def _zero(f: Flags) -> ZeroConfig:
    return ZeroConfig(stage=f.zero_stage, reduce_bucket_size=f.reduce_bucket_size,
                      allgather_bucket_size=f.allgather_bucket_size, overlap_comm=f.overlap_comm,
                      param_persistence_threshold=f.zero_param_persistence_threshold)


def _adamw(f: Flags) -> AdamWConfig:
    return AdamWConfig(beta1=f.adam_beta1, beta2=f.adam_beta2, eps=f.adam_eps,
                       weight_decay=f.weight_decay, clip_grad=f.clip_grad)


def _precision(f: Flags) -> PrecisionConfig:
    return PrecisionConfig(
        params_dtype="bf16" if f.bf16 else "fp16" if f.fp16 else "fp32",
        grads_in_fp32=bool(f.accumulate_allreduce_grads_in_fp32), loss_scale=f.loss_scale,
        initial_loss_scale=f.initial_loss_scale, min_loss_scale=f.min_loss_scale,
        loss_scale_window=f.loss_scale_window, hysteresis=f.hysteresis)


def _offload(f: Flags) -> OffloadConfig:
    return OffloadConfig(
        optimizer=f.offload_optimizer, param=f.offload_param,
        nvme_path=f.offload_nvme_path, buffer_count=f.offload_buffer_count,
        buffer_size=f.offload_buffer_size, pin_memory=f.offload_pin_memory,
        delayed_update=f.offload_delayed_update,
        delayed_update_warmup=f.offload_delayed_update_warmup, gds=f.offload_gds)


def _recompute(f: Flags) -> RecomputeConfig:
    return RecomputeConfig(
        granularity=f.recompute_granularity,
        num_layers=f.recompute_num_layers if f.recompute_method == "block" else None,
        layers_per_checkpoint=(f.recompute_num_layers or 1
                               if f.recompute_method == "uniform" else 1),
        # With SP a block's input is already this rank's 1/TP of the sequence:
        # nothing replicated is left to partition (see docs/sequence-parallelism.md).
        partition_activations=f.partition_activations and not f.sequence_parallel,
        cpu_checkpointing=f.cpu_checkpointing,
        contiguous_checkpointing=f.contiguous_checkpointing)


def _data(f: Flags, environ: Mapping[str, str] | None) -> DataConfig:
    return DataConfig(
        seq_length=f.seq_length, seed=f.seed, data_path=_paths(f.data_path), split=f.split,
        train_data_path=_paths(f.train_data_path),
        valid_data_path=_paths(f.valid_data_path), test_data_path=_paths(f.test_data_path),
        mock_data=f.mock_data, cache_path=f.data_cache_path, eod_mask_loss=f.eod_mask_loss,
        corpus_cache=f.data_cache_path or _user_cache_dir(environ))


def _user_cache_dir(environ: Mapping[str, str] | None) -> str | None:
    """Where the built-in corpus is kept between runs when no --data-cache-path is
    given: hybrid's directory in the user's cache ($XDG_CACHE_HOME, else ~/.cache, as
    XDG says), from the entry point's ``environ`` (None: nowhere, parse each time)."""
    if environ is None:
        return None
    base = environ.get("XDG_CACHE_HOME")
    if not base and environ.get("HOME"):
        base = os.path.join(environ["HOME"], ".cache")
    return os.path.join(base, "hybrid") if base else None


def _paths(values: list[str] | None) -> tuple[str, ...] | None:
    return tuple(values) if values else None


def _tokenizer(f: Flags) -> TokenizerConfig:
    return TokenizerConfig.from_flags(f.tokenizer_type, f.vocab_file, f.merge_file,
                                      f.tokenizer_model, f.tokenizer_file, f.vocab_size)


def _checkpoint(f: Flags) -> CheckpointConfig:
    return CheckpointConfig(
        save=f.save, load=f.load, save_interval=f.save_interval, keep_last=f.keep_last,
        no_save_optim=f.no_save_optim, no_load_optim=f.no_load_optim,
        no_load_rng=f.no_load_rng, finetune=f.finetune, ckpt_step=f.ckpt_step,
        overwrite_save=f.overwrite_save)


def _logging(f: Flags) -> LoggingConfig:
    return LoggingConfig(log_interval=f.log_interval, log_json=f.log_json,
                         tensorboard_dir=f.tensorboard_dir, log_throughput=f.log_throughput,
                         timing_breakdown=f.timing_breakdown)


def _diagnostics(f: Flags) -> DiagnosticsConfig:
    return DiagnosticsConfig(collective_dump_dir=f.collective_dump_dir,
                             check_collectives=f.check_collectives,
                             check_replicas_interval=f.check_replicas_interval)


def _kernels(f: Flags, environ: Mapping[str, str] | None) -> KernelConfig:
    """The kernel flags, each left unset filled from its HYBRID_* variable in
    ``environ`` (:func:`hybrid.config.kernels.kernel_config_from_env`); the filled
    values go back into ``f`` so the log and checkpoint metadata show what ran."""
    env = kernel_config_from_env(environ) if environ is not None else KernelConfig()
    f.no_kernels = bool(f.no_kernels or env.no_kernels)
    if f.kernel_cache_dir is None:
        f.kernel_cache_dir = env.cache_dir
    if f.kernel_choice is None:
        choice = env.choice
        f.kernel_choice = ",".join(f"{op}={path}" for op, path in choice) or None
    else:
        choice = parse_kernel_choice(f.kernel_choice, "--kernel-choice")
    return KernelConfig(no_kernels=f.no_kernels, cache_dir=f.kernel_cache_dir, choice=choice,
                        cuda_arch_list=env.cuda_arch_list)
