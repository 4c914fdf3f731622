"""The command line: Megatron-compatible flags -> :class:`Flags`, one field per flag.

Megatron users bring launch scripts full of flags. Each flag hybrid implements
is declared once, on the field that takes it (:mod:`hybrid.config.options` says how,
:mod:`hybrid.config.flag_sources` lists where), and :class:`Flags` is generated from
those declarations (``hybrid/config/flag_fields.py``). This module turns a command line
into Flags: argparse's parser, one group per section, built from the fields' metadata;
:mod:`hybrid.config.megatron_flags` knows the rest of Megatron's flags, so they get a
named answer (ignored with a note, or refused with what to use instead) rather than
argparse's "unrecognized arguments". No torch import: the launcher checks a command line
before it starts any worker.

:data:`ROUTES` says which section field takes each flag's checked value;
:func:`hybrid.config.build_config` cuts each section by that table: there is no
hand-written mapper to keep in step. Explicit code remains only for fields derived from
several flags or from outside them (the LR schedule's unit and lengths, the recompute
method, the dtypes, the tokenizer, the kernels' environment defaults): see
:mod:`hybrid.config.build`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from typing import Any, NoReturn

from hybrid.config.flag_fields import Flags
from hybrid.config.options import flag_name
from hybrid.errors import ConfigError

__all__ = ["ROUTES", "Flags", "build_parser", "field_type", "flag_name", "parse_args"]


def _routes() -> dict[str, dict[str, str]]:
    table: dict[str, dict[str, str]] = {}
    for f in dataclasses.fields(Flags):
        for target in f.metadata.get("to", ()):
            section, _, name = target.partition(".")
            fields = table.setdefault(section, {})
            name = name or f.name
            if name in fields:  # one field, one source: a second would silently win
                raise TypeError(f"Flags.{f.name} and Flags.{fields[name]} both go to "
                                f"{section}.{name}")
            fields[name] = f.name
    return table


# section -> {its field: the Flags field whose checked value it takes}, from every flag's
# ``to`` (the module note). Read-only: build_config and ModelConfig.from_flags cut by it.
ROUTES: dict[str, dict[str, str]] = _routes()


def build_parser(explicit_only: bool = False,
                 cls: type[argparse.ArgumentParser] = argparse.ArgumentParser
                 ) -> argparse.ArgumentParser:
    """One flag per :class:`Flags` field, named as Megatron names it. ``explicit_only``:
    no defaults, so a parse holds only the flags the command line gave. ``cls``: the
    parser's class (:func:`parse_args` takes one whose errors are ConfigErrors)."""
    p = cls(
        prog="pretrain_gpt.py", description="Pretrain a GPT with tensor x data parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(Flags):
        if f.metadata.get("cli") is False:
            continue
        title = f.metadata["group"]
        group = groups.get(title) or groups.setdefault(title, p.add_argument_group(title))
        names = [flag_name(f.name)] + ([f.metadata["alias"]] if f.metadata.get("alias") else [])
        kind, many = field_type(f)
        kw: dict[str, Any] = dict(
            dest=f.name, default=argparse.SUPPRESS if explicit_only else f.default,
            help=f.metadata.get("help"))
        if "metavar" in f.metadata:
            kw["metavar"] = f.metadata["metavar"]
        elif "choices" in f.metadata:  # shown as argparse shows choices; check_fields checks
            kw["metavar"] = "{" + ",".join(map(str, f.metadata["choices"])) + "}"
        if "const" in f.metadata:
            kw.update(nargs="?", const=f.metadata["const"])
        # tri-state (--x / --no-x / a derived default), or on by default (--no-x turns it off)
        if kind is bool and f.default is not False:
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        elif kind is bool:
            group.add_argument(*names, action="store_true", **kw)
        else:
            kw.setdefault("nargs", "+" if many else None)
            kw.setdefault("metavar", f.name.split("_")[-1].upper())
            group.add_argument(*names, type=kind, **kw)
    return p


def field_type(f: dataclasses.Field) -> tuple[type, bool]:
    """(element type, is a list) of a field annotated like 'int', 'str | None', 'list[str]'."""
    t = str(f.type).replace("typing.", "")
    many = t.startswith("list[")
    head = t[5:].split("]")[0] if many else t.split(" ")[0]
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if head == name:
            return kind, many
    raise TypeError(f"unsupported flag field type {f.type!r} for {f.name}")


def parse_args(argv: list[str] | None = None) -> Flags:
    """Parse a command line into :class:`Flags` (checked later: that needs the world size).

    Megatron flags hybrid does not implement raise one ConfigError naming them
    (see :mod:`hybrid.config.megatron_flags`); those that only pick a Megatron
    implementation are dropped, and :attr:`Flags.ignored_megatron_flags` lists them.
    """
    from hybrid.config.megatron_flags import split_megatron_flags
    known = {flag_name(f.name) for f in dataclasses.fields(Flags)}
    ours, ignored = split_megatron_flags(list(sys.argv[1:] if argv is None else argv), known)
    parser = build_parser(cls=_RaisingParser)
    ns, unknown = parser.parse_known_args(ours)
    if unknown:
        raise ConfigError(_unknown_message(unknown[0]))
    given = build_parser(explicit_only=True).parse_known_args(ours)[0]
    return Flags(**vars(ns), ignored_megatron_flags=ignored, explicit_flags=sorted(vars(given)))


def _unknown_message(arg: str) -> str:
    name = arg.partition("=")[0]
    if not name.startswith("-"):
        return f"unexpected argument {arg!r} (every value follows its --flag)"
    known = [flag_name(f.name) for f in dataclasses.fields(Flags)]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (f"{name} is not a flag hybrid knows, nor a Megatron-LM flag it maps "
            f"(README: 'Coming from Megatron-LM'){hint}")


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose errors are one ConfigError, not argparse's usage dump + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)
