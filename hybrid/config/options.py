"""How a field declares the command-line flag that fills it: :func:`opt` and :func:`route`.

[Note: each option declared once]
An option is written once, on the field that takes it: the section field its
component reads (:mod:`hybrid.config.sections`, :class:`hybrid.config.model.ModelConfig`),
or, for a flag no section takes as it is (the inputs of derived fields, Megatron's
other names), a field of an input class beside the code that derives from it
(:class:`hybrid.config.sections.LRLengthFlags` beside ``LRScheduleConfig.derived``,
:class:`hybrid.config.stage_split.SplitFlags`,
:class:`hybrid.config.architecture.ArchitectureFlags`).
The field carries the flag's Megatron name, its --help text, what the value alone must
be, and the ds_config key(s) that set it::

    stage: int = opt(0, "0: all-reduce DP, 1: shard optimizer states, ...",
                     flag="zero_stage", choices=(0, 1, 2, 3), ds="zero_optimization.stage")

Everything else is generated from that: the flat :class:`hybrid.config.flags.Flags`
(``hybrid/config/flag_fields.py``, written by ``python -m hybrid.config.generate``
and held to its sources by a test), argparse's parser and its --help groups, the routes
:func:`hybrid.config.build_config` cuts the sections by, the ds_config key table
(:data:`hybrid.config.deepspeed_keys.KEYS`) and the single-option checks
(:func:`hybrid.config.checks.check_fields`: "--zero-stage must be 0, 1, 2 or 3, got 5").
A check that reads two or more options stays in :mod:`hybrid.config.checks`. A second
section that takes the same value names the flag with :func:`route` (``DataConfig.seq_length``
takes ``--seq-length``, which ``ModelConfig.seq_length`` declares).

No imports beyond :mod:`hybrid.config.kinds`: every declaring module sits above this one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import Field, dataclass, field
from typing import Any

from hybrid.config.kinds import Kind

# The bounds opt takes, as a field's metadata names them (checks.check_fields reads them)
BOUNDS = ("at_least", "above", "at_most", "below")
# a flag's default that differs from its field's: the checks fill it (None: "derive it")
_SAME = object()


@dataclass(frozen=True)
class DsKey:
    """A ds_config key that sets a flag's field (``opt(ds=...)``): its dotted ``path``; the
    ``kind`` its value must have (:mod:`hybrid.config.kinds`; None: the field's
    annotation); ``convert``: the checked value -> the field's value (None: as it is)."""

    path: str
    kind: Kind | None = None
    convert: Callable[[Any], Any] | None = None


def opt(default: Any, help: str, alias: str | None = None, *, flag: str | None = None,
        flag_default: Any = _SAME, choices: Collection | None = None,
        refused: Mapping[Any, str] | None = None, at_least: float | None = None,
        above: float | None = None, at_most: float | None = None, below: float | None = None,
        ds: str | DsKey | tuple[str | DsKey, ...] = (), **argparse_kw: Any) -> Any:
    """A field that declares a flag: its default, --help text and optional alias flag.

    ``flag``: the flag's name as a Flags field, Megatron's spelling with underscores
    (default: the field's own name; ``--zero-stage`` fills ``ZeroConfig.stage``).
    ``flag_default``: the flag's default where it differs from the field's: None for a
    value the checks derive when the flag is not given (``--global-batch-size``: micro x
    DP), so the section's field never holds None.

    What the value alone must be (:func:`hybrid.config.checks.check_fields`; None passes
    where the flag's default is None): ``choices``, a closed set (``--help`` shows it);
    ``refused``: values outside it whose message says why (a Megatron value hybrid
    lacks -> the reason); the bounds ``at_least`` (>=), ``above`` (>), ``at_most``
    (<=), ``below`` (<). ``ds``: the ds_config key(s) that set the value, a dotted path
    or a :class:`DsKey`. ``argparse_kw``: ``const`` for a flag whose value may be left
    out (``nargs="?"``), ``metavar`` for a set too long to show."""
    if choices is not None and {at_least, above, at_most, below} != {None}:
        raise TypeError("opt: a closed set or bounds, not both")
    keys = ds if isinstance(ds, tuple) else (ds,)
    meta: dict[str, Any] = {
        "help": help, "alias": alias, "flag": flag,
        "ds": tuple(DsKey(k) if isinstance(k, str) else k for k in keys), **argparse_kw}
    if flag_default is not _SAME:
        meta["flag_default"] = flag_default
    given = {"choices": choices, "refused": refused, "at_least": at_least, "above": above,
             "at_most": at_most, "below": below}
    meta.update((name, value) for name, value in given.items() if value is not None)
    return field(default=default, metadata=meta)


def route(flag: str, default: Any) -> Any:
    """A field that takes the value of a flag another field declares (``flag``, as a Flags
    field), with its own ``default`` for a section built by hand."""
    return field(default=default, metadata={"route": flag})


def declares(f: Field) -> bool:
    """True when the field declares a flag (:func:`opt`)."""
    return "help" in f.metadata


def flag_of(f: Field) -> str | None:
    """The Flags field that fills ``f``: the flag it declares or routes from, else None."""
    if declares(f):
        return f.metadata["flag"] or f.name
    return f.metadata.get("route")


def flag_name(field_name: str) -> str:
    """The command-line spelling of a Flags field: ``zero_stage`` -> ``--zero-stage``."""
    return "--" + field_name.replace("_", "-")
