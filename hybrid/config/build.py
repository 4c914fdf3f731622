"""Flat Megatron flags -> one checked, nested :class:`TrainConfig`, in one place.

:func:`build_config` runs every check that can reject a run
(:mod:`hybrid.config.checks`; every message names the flag to change) and
returns frozen sections (:mod:`hybrid.config.sections`); each component takes
only its own. No torch import: the launcher checks a command line in a
fraction of a second before it starts any worker.

A section is cut by :func:`_section` from the flags its fields declare
(:data:`hybrid.config.flags.ROUTES`; the note of :mod:`hybrid.config.options`). The
code below holds only what no single flag says: the fields derived from several
flags or from outside them (the world size, the environment), and the three
sections with their own constructors (model, tokenizer, kernels).
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass

from hybrid.config import checks
from hybrid.config.architecture import validate_architecture
from hybrid.config.deepspeed import apply_ds_config, load_ds_config
from hybrid.config.flags import ROUTES, Flags, flag_name
from hybrid.config.kernels import kernel_config_from_env, parse_kernel_choice
from hybrid.config.model import ModelConfig
from hybrid.config.moe import validate_moe
from hybrid.config.sections import (
    AdamWConfig,
    CheckpointConfig,
    DataConfig,
    DiagnosticsConfig,
    KernelConfig,
    LoggingConfig,
    LoopConfig,
    LRScheduleConfig,
    OffloadConfig,
    ParallelConfig,
    PipelineConfig,
    PrecisionConfig,
    RecomputeConfig,
    TokenizerConfig,
    ZeroConfig,
)
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
    pipeline: PipelineConfig
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
                 environ: Mapping[str, str] | None = None, *,
                 plan_only: bool = False) -> TrainConfig:
    """Check ``flags`` for ``world_size`` ranks and cut them into sections.

    ``flags`` is not modified; the returned config's ``flags`` is a copy with
    the derived defaults filled in. ``environ``: the entry point's environment,
    whose ``HYBRID_*`` variables default the kernel flags and whose cache directory
    keeps the parsed built-in corpus (None: flags only). ``plan_only``: a config to
    plan with, not to run (the memory estimator): what this hybrid could plan but
    not run yet would be let through; nothing is now (pipeline stages combine with
    everything since tied embeddings run with an offloaded optimizer), so it changes
    no check.
    Every check runs first (:func:`_check`); then each section is cut from the
    checked flags routed to it, plus its derived fields (only ``_kernels`` writes
    back into the flags: the kernel flags it fills from ``environ``).
    """
    f = dataclasses.replace(flags)
    _deepspeed(f, world_size)
    dp = _check(f, world_size, plan_only)
    return TrainConfig(
        parallel=_section(f, "parallel", world_size=world_size, data_parallel_size=dp),
        pipeline=_section(f, "pipeline", split=checks.stage_split(f)),
        model=ModelConfig.from_flags(f),
        lr_schedule=_section(f, "lr_schedule", **LRScheduleConfig.derived(f)),
        loop=_section(f, "loop"), zero=_section(f, "zero"),
        adamw=_section(f, "adamw", clip_norm_of="model"),
        precision=_section(f, "precision", **PrecisionConfig.derived(f)),
        offload=_section(f, "offload"),
        recompute=_section(f, "recompute", **RecomputeConfig.derived(f)),
        data=_section(f, "data", corpus_cache=f.data_cache_path or _user_cache_dir(environ)),
        tokenizer=TokenizerConfig.from_flags(f), checkpoint=_section(f, "checkpoint"),
        logging=_section(f, "logging"), kernels=_kernels(f, environ),
        diagnostics=_section(f, "diagnostics"), seed=f.seed, flags=f)


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
    dp = check_layout(world_size, f.tensor_model_parallel_size, f.context_parallel_size,
                      f.pipeline_model_parallel_size)
    f.ds_config_notes = apply_ds_config(f, load_ds_config(path), dp, source=path)


def _check(f: Flags, world_size: int, plan_only: bool = False) -> int:
    """Every check that can reject the run, in order; fills derived defaults into ``f``.
    Returns the data-parallel size. A message names a value by the name the user gave
    it (:func:`_as_given`)."""
    try:
        return _run_checks(f, world_size, plan_only)
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
                         _verbatim(name), message)
    return message


def _verbatim(text: str) -> typing.Callable[[re.Match[str]], str]:
    """A :func:`re.sub` replacement that inserts ``text`` as it is (a string
    replacement would read its backslashes as escapes)."""
    return lambda _: text


def _run_checks(f: Flags, world_size: int, plan_only: bool) -> int:
    dp = check_layout(world_size, f.tensor_model_parallel_size, f.context_parallel_size,
                      f.pipeline_model_parallel_size)
    checks.canonical_offload(f)
    checks.check_fields(f)  # what each flag alone must be: its field's opt(choices=, ...)
    checks.check_parallel(f)
    checks.check_model(f)
    validate_architecture(f)  # the Llama-family flags; fills the SwiGLU width
    validate_moe(f, world_size)  # the MoE flags that read each other, the expert layout
    checks.check_batch(f, dp)
    checks.check_pipeline(f, dp)  # (after the batch: interleaving needs its micro-batches)
    checks.check_schedule(f)
    checks.check_zero(f)
    checks.check_recompute(f)
    checks.check_data(f)
    checks.check_data_paths(f)
    checks.check_checkpoint(f)
    checks.check_output_dirs(f)
    return dp


# -- cutting the sections -----------------------------------------------------------------
# Each section's class by the name TrainConfig holds it under, the name a flag's ``to``
# says ("offload": OffloadConfig): every field of TrainConfig but the run's seed and flags.
SECTION_TYPES: dict[str, type] = {name: kind for name, kind in
                                  typing.get_type_hints(TrainConfig).items()
                                  if name not in ("seed", "flags")}


def _section(f: Flags, name: str, **derived):
    """Section ``name`` of checked flags ``f``: each field that declares or routes a flag
    (``opt``/``route``, :data:`~hybrid.config.flags.ROUTES`) takes that flag's value, a list
    as a tuple (None when empty: a frozen section holds no list); ``derived`` gives the
    rest. A field with no source, or two, is a TypeError: a flag or a field added without
    saying how the one reaches the other fails every build, never silently takes a
    default."""
    cls = SECTION_TYPES[name]
    routed = {field: _frozen(getattr(f, flag)) for field, flag in ROUTES.get(name, {}).items()}
    missing = {fld.name for fld in dataclasses.fields(cls)} - routed.keys() - derived.keys()
    if missing:
        raise TypeError(f"section {name}: no flag is routed to {sorted(missing)} (opt or route) "
                        f"and build.py derives none of them")
    if routed.keys() & derived.keys():
        raise TypeError(f"section {name}: {sorted(routed.keys() & derived.keys())} both "
                        f"routed from a flag and derived")
    return cls(**routed, **derived)


def _frozen(value):
    return (tuple(value) if value else None) if isinstance(value, list) else value


# -- the derived fields: each depends on more than one flag, or on the environment -------
# (a section's fields derived from several flags are derived by the section itself, beside
# the input flags it declares: LRScheduleConfig.derived, PrecisionConfig.derived, ...)
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
