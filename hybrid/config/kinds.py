"""The type a configuration value must have, and the one check of a value against it.

A ds_config key (:data:`hybrid.config.deepspeed_keys.KEYS` declares each key's kind,
or takes it from the :class:`~hybrid.config.flags.Flags` field it sets) and a
``hybrid.initialize`` argument meet their kind in :func:`typed`, which returns the
value as hybrid holds it or raises one ConfigError naming the value as the user
wrote it and what to write instead::

    typed("false", BOOL, "ds_config fp16.enabled (ds.json)")  # ConfigError:
    ds_config fp16.enabled (ds.json) must be true or false, got "false": write false without quotes

[Note: checked, not converted]
Python's ``bool("false")`` is True and ``int(2.7)`` is 2: converting a value turns a
quoted "false" into fp16 on and stage 2.7 into ZeRO-2, with no word. So nothing is
converted that has not first passed its kind: JSON true/false for a switch (not
"true", "yes" or 1), a number for a rate or a size (not true/false, which Python
counts as ints, and not a quoted number), a string for a name.

[Note: whole numbers]
JSON has one number type: ``2`` and ``2.0`` are the same number, and DeepSpeed's
docs write sizes as ``5e8`` (a float to Python's parser). So a count takes any
number without a fraction (``2.0`` is 2, ``5e8`` is 500000000) and refuses one with
a fraction (``2.7``).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hybrid.errors import ConfigError

__all__ = ["Kind", "BOOL", "INT", "NUMBER", "STRING", "OBJECT", "PAIR", "one_of", "typed",
           "show"]


@dataclass(frozen=True)
class Kind:
    """What a value must be: ``base`` one of bool, int, number, string, object, pair
    (two numbers) or choice (one of ``choices``); ``nullable``: null (None) passes too."""

    base: str
    choices: tuple = ()
    nullable: bool = False

    def or_null(self) -> Kind:
        return replace(self, nullable=True)

    @property
    def what(self) -> str:
        """The kind as a message says it ("must be {what}")."""
        if self.base == "choice":
            return "one of " + ", ".join(show(c) if c is None else str(c) for c in self.choices)
        return _WHAT[self.base]


_WHAT = {"bool": "true or false", "int": "a whole number", "number": "a number",
         "string": "a string", "object": "an object ({\"key\": value, ...})",
         "pair": "two numbers ([a, b])"}
BOOL, INT, NUMBER, STRING = Kind("bool"), Kind("int"), Kind("number"), Kind("string")
OBJECT, PAIR = Kind("object"), Kind("pair")


def one_of(*choices) -> Kind:
    """A string from ``choices`` (None among them: null passes too)."""
    return Kind("choice", tuple(choices), nullable=None in choices)


def typed(value: Any, kind: Kind, name: str):
    """``value`` as hybrid holds a ``kind`` (a count as an int, a rate as a float, a pair
    as a tuple of floats), or one ConfigError: "{name} must be {kind.what}, got {value}",
    with the fix where one is clear (a quoted true, false or number: write it without
    quotes). See the module notes."""
    if value is None and kind.nullable:
        return None
    base = kind.base
    if base == "bool" and isinstance(value, bool):
        return value
    whole = _whole(value) if base == "int" else None
    if whole is not None:
        return whole
    if base == "number" and _number(value):
        return float(value)
    if base == "string" and isinstance(value, str):
        return value
    if base == "object" and isinstance(value, Mapping):
        return value
    if base == "choice" and isinstance(value, str) and value in kind.choices:
        return value
    if (base == "pair" and isinstance(value, (list, tuple)) and len(value) == 2
            and all(_number(v) for v in value)):
        return float(value[0]), float(value[1])
    raise ConfigError(f"{name} must be {kind.what}, got {show(value)}{_fix(value, kind)}")


def show(value: Any) -> str:
    """``value`` as JSON writes it (``"false"`` quoted, null, true), cut to one short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(value) -> bool:
    # bool is an int to Python, never a number to a user
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _whole(value) -> int | None:
    """The int ``value`` is (5e8 and 2.0 too: the whole-numbers note), else None."""
    if not _number(value):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    v = float(value)
    return int(v) if math.isfinite(v) and v.is_integer() else None


_SAID = {"true": "true", "yes": "true", "on": "true", "1": "true",
         "false": "false", "no": "false", "off": "false", "0": "false"}


def _fix(value, kind: Kind) -> str:
    """": write ..." for a value whose meaning is clear but whose type is not, else ""."""
    if kind.base == "bool":
        if isinstance(value, str) and value.strip().lower() in _SAID:
            return f": write {_SAID[value.strip().lower()]} without quotes"
        if isinstance(value, str):
            return ": write true or false, without quotes"
        if _number(value) and value in (0, 1):
            return f": write {'true' if value else 'false'}"
        return ""
    if kind.base in ("int", "number") and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return ""
        if not math.isfinite(number):
            return ""
        if kind.base == "number" or _whole(number) is not None:
            return f": write {value.strip()} without quotes"
    if kind.base == "object" and value is None:
        return ": leave it out, or write {}"
    return ""
