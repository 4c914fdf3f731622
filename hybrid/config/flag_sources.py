"""Where every flag is declared, and the generator of the flat :class:`~hybrid.config.flags.Flags`.

:data:`SOURCES` lists the classes whose fields declare flags
(:func:`hybrid.config.options.opt`; the note there), in ``--help`` order, each with the
title of its ``--help`` group and, for a section, the name :class:`hybrid.config.TrainConfig`
holds it under. :func:`render` writes ``hybrid/config/flag_fields.py`` from them: one
typed ``Flags`` field per declared flag, so mypy and a reader see the flat flags as
Megatron names them, while the default, help, constraints and ds_config keys stay on the
declaring field (:func:`declared` reads them at import). Regenerate after adding or
renaming a flag::

    python -m hybrid.config.generate

(tests/config/test_single_definition.py fails until the file matches).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from dataclasses import dataclass
from typing import Any

from hybrid.config.architecture import ArchitectureFlags
from hybrid.config.model import ModelConfig
from hybrid.config.moe import MoEConfig
from hybrid.config.options import declares, flag_of
from hybrid.config.sections import (
    AdamWConfig,
    CheckpointConfig,
    DataConfig,
    DeepSpeedFlags,
    DiagnosticsConfig,
    DtypeFlags,
    KernelFlags,
    LoggingConfig,
    LoopConfig,
    LRLengthFlags,
    LRScheduleConfig,
    MegatronZeroFlags,
    OffloadConfig,
    ParallelConfig,
    PipelineConfig,
    PrecisionConfig,
    RecomputeConfig,
    RecomputeFlags,
    TokenizerFlags,
    ZeroConfig,
)
from hybrid.config.stage_split import SplitFlags


@dataclass(frozen=True)
class Source:
    """A class whose fields declare flags: its ``--help`` group ``title`` and, for a
    section, the ``section`` name TrainConfig holds it under (None: an input class)."""

    title: str
    cls: type
    section: str | None = None


SOURCES: tuple[Source, ...] = (
    Source("parallelism", ParallelConfig, "parallel"),
    Source("pipeline parallelism", PipelineConfig, "pipeline"),
    Source("pipeline parallelism", SplitFlags),
    Source("model", ModelConfig, "model"),
    Source("model", ArchitectureFlags),
    Source("mixture of experts", MoEConfig),
    Source("batch, length and evaluation", LoopConfig, "loop"),
    Source("learning rate", LRScheduleConfig, "lr_schedule"),
    Source("learning rate", LRLengthFlags),
    Source("AdamW", AdamWConfig, "adamw"),
    Source("ZeRO data parallelism", ZeroConfig, "zero"),
    Source("ZeRO data parallelism", MegatronZeroFlags),
    Source("offload (ZeRO-Offload, ZeRO-Infinity)", OffloadConfig, "offload"),
    Source("mixed precision", PrecisionConfig, "precision"),
    Source("mixed precision", DtypeFlags),
    Source("activation checkpointing (ZeRO-R)", RecomputeConfig, "recompute"),
    Source("activation checkpointing (ZeRO-R)", RecomputeFlags),
    Source("data", DataConfig, "data"),
    Source("data", TokenizerFlags),
    Source("checkpoints", CheckpointConfig, "checkpoint"),
    Source("logging", LoggingConfig, "logging"),
    Source("diagnostics", DiagnosticsConfig, "diagnostics"),
    Source("kernels", KernelFlags),
    Source("DeepSpeed", DeepSpeedFlags),
)


@dataclass(frozen=True)
class Declaration:
    """One flag: the ``field`` that declares it, the ``source`` class holding that field,
    the Flags ``annotation`` (the field's, a tuple as the list the command line gives,
    with None when the flag's default is), and ``routes``: every ``"section.field"``
    that takes its checked value (the declaring field first, when it is a section's)."""

    field: dataclasses.Field
    source: Source
    annotation: str
    routes: tuple[str, ...]

    @property
    def default(self) -> Any:
        return self.field.metadata.get("flag_default", self.field.default)


def _flag_annotation(f: dataclasses.Field) -> str:
    """The Flags type of a declaring field: a tuple becomes a list (argparse's nargs), and
    a flag whose default is None (``opt(flag_default=None)``) admits None."""
    t = re.sub(r"tuple\[(\w+)(?:, (?:\1|\.\.\.))*\]", r"list[\1]", str(f.type))
    if f.metadata.get("flag_default", f.default) is None and "None" not in t.split(" | "):
        t += " | None"
    return t


def _declarations() -> dict[str, Declaration]:
    found: dict[str, tuple[dataclasses.Field, Source]] = {}
    routes: dict[str, list[str]] = {}
    for source in SOURCES:
        for f in dataclasses.fields(source.cls):
            flag = flag_of(f)
            if flag is None:
                continue
            if declares(f):
                if flag in found:  # declared twice: one would silently win
                    raise TypeError(f"--{flag} is declared by {found[flag][1].cls.__name__}."
                                    f"{found[flag][0].name} and {source.cls.__name__}.{f.name}")
                found[flag] = (f, source)
            if source.section is not None:
                routes.setdefault(flag, []).append(f"{source.section}.{f.name}")
    unknown = sorted(routes.keys() - found.keys())
    if unknown:
        raise TypeError(f"route() names flags nobody declares: {unknown}")
    return {flag: Declaration(f, source, _flag_annotation(f), tuple(routes.get(flag, ())))
            for flag, (f, source) in found.items()}


# flag (a Flags field's name) -> its declaration, in SOURCES order
DECLARATIONS: dict[str, Declaration] = _declarations()


def declared(flag: str) -> Any:
    """The Flags field of ``flag``: its flag default, and the declaring field's metadata
    plus ``to`` (the routes) and ``group`` (the --help title). A name no longer declared
    gives a field the parser skips, so a stale flag_fields.py still imports and can be
    regenerated (the test names it)."""
    d = DECLARATIONS.get(flag)
    if d is None:
        return dataclasses.field(default=None, metadata={"cli": False, "stale": True})
    meta = {**d.field.metadata, "to": d.routes, "group": d.source.title}
    default = d.default
    if isinstance(default, tuple):  # a list flag: argparse gives a list
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


GENERATED = pathlib.Path(__file__).with_name("flag_fields.py")

_HEADER = '''"""The flat command-line flags: GENERATED by ``python -m hybrid.config.generate``.

Do not edit: a flag is declared on the field that takes it
(:mod:`hybrid.config.flag_sources` lists where; :mod:`hybrid.config.options` says how).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid.config.flag_sources import declared


@dataclass
class Flags:
    """One field per command-line flag, flat, named as Megatron names it.

    Plain data, not yet checked: ``build_config(flags, world_size)``
    (:func:`hybrid.config.build_config`) turns it into the nested, frozen
    :class:`hybrid.config.TrainConfig` the components take.
    """
'''

_TRAILER = '''
    # not flags: the Megatron flags parse_args dropped as having no effect here, the
    # flags the command line gave (a ds_config may not contradict them), what the
    # ds_config accepted without effect, and the fields set other than by their flag
    # (field -> the name the user gave the value by: "ds_config zero_optimization.stage",
    # "hybrid.initialize(seed=...)"), which build_config's messages say instead of the flag
    ignored_megatron_flags: list[str] = field(default_factory=list, metadata={"cli": False})
    explicit_flags: list[str] = field(default_factory=list, metadata={"cli": False})
    ds_config_notes: list[str] = field(default_factory=list, metadata={"cli": False})
    given_as: dict[str, str] = field(default_factory=dict, metadata={"cli": False})
'''


def render() -> str:
    """The source of ``flag_fields.py``: a field per declared flag, by --help group, each
    group headed by the classes that declare its flags, a flag whose declaring field has
    another name with that field's."""
    lines: list[str] = [_HEADER.rstrip("\n")]
    title = None
    for flag, d in DECLARATIONS.items():
        if d.source.title != title:
            title = d.source.title
            classes = dict.fromkeys(s.cls.__name__ for s in SOURCES if s.title == title)
            lines += ["", f"    # -- {title}: {', '.join(classes)}"]
        call = f"declared({flag!r})".replace("'", '"')
        line = f"    {flag}: {d.annotation} = {call}"
        if len(line) > 100:
            line = f"    {flag}: {d.annotation} = declared(\n        {flag!r})".replace("'", '"')
        if d.field.name != flag:
            where = f"  # {d.source.cls.__name__}.{d.field.name}"
            first, _, rest = line.partition("\n")
            line = (first + where + ("\n" + rest if rest else "")
                    if len(first + where) <= 100 else f"    #{where[3:]}\n{line}")
        lines.append(line)
    lines.append(_TRAILER)
    return "\n".join(lines)
