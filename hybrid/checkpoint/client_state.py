"""The ``client_state`` of an API checkpoint: any picklable values, loaded back safely.

``engine.save_checkpoint(dir, client_state={...})`` (:mod:`hybrid.checkpoint.api_state`)
has rank 0 write the state with ``torch.save`` as ``client_state.pt`` beside the
checkpoint's ``metadata.json``; ``engine.load_checkpoint`` returns it on every rank.
It is loaded with ``torch.load(..., weights_only=True, map_location="cpu")``: a
checkpoint is a file others hand around, and a plain unpickle of one runs whatever
code it names. Tensors come back on the CPU, as DeepSpeed's ``load_checkpoint``
returns them (its checkpoint engine loads with CPU storages).

[Note: what loads]
``weights_only`` rebuilds tensors, dicts, lists, tuples, sets, numbers, strings,
bytes, ``None``, ``collections.OrderedDict`` and ``Counter``, torch dtypes, devices
and sizes. Hybrid accepts these too (:data:`DEFAULT_TYPES`, with :func:`_numpy_types`):

* ``argparse.Namespace`` (DeepSpeed scripts save their ``args``);
* ``frozenset``, ``slice``, ``range``;
* ``pathlib`` paths, ``datetime`` dates, times and durations;
* numpy arrays, scalars and dtypes, when numpy is installed.

Anything else is allowed by the user, per process, on every rank, before saving
and before loading: :func:`allow_client_state_types` (also exported as
``hybrid.checkpoint.allow_client_state_types``). Types put on torch's own list
(``torch.serialization.add_safe_globals``) are accepted as well. Two collections
types cannot be rebuilt by torch's safe loader even when allowed
(``collections.deque``, ``collections.defaultdict``: it fills only lists and
dicts): store them as a list or a dict.

[Note: refused at the save]
:func:`encode` loads what it wrote back under the same loader before anything is
written, so a value that would not load is refused when it is saved, naming the
value (``client_state['args'].opt``), its type, and what to do, rather than at
the resume hours later.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import io
import pathlib
import sys
from collections.abc import Iterator, Mapping

import torch

from hybrid.errors import CheckpointError

FILE = "client_state.pt"

# Beyond weights_only's own (the module note): small value types whose rebuilding
# runs no code of the file's choosing.
DEFAULT_TYPES: tuple = (argparse.Namespace, frozenset, slice, range,
                        pathlib.PurePosixPath, pathlib.PureWindowsPath, type(pathlib.Path()),
                        datetime.date, datetime.time, datetime.datetime, datetime.timedelta,
                        datetime.timezone)

_ADDED: list = []  # allow_client_state_types' (this process)

# Allowed or not, torch's safe loader fills only lists and dicts (and OrderedDict, Counter):
# a non-empty one of these is refused whatever the allow-list says.
_NOT_REBUILT = {collections.deque: "a list", collections.defaultdict: "a dict"}

_HOW = ("call hybrid.checkpoint.allow_client_state_types({names}) on every rank before "
        "save_checkpoint and load_checkpoint")
_PLAIN = "store it as plain values (dicts, lists, numbers, strings, tensors)"


@functools.cache
def _numpy_types() -> tuple:
    """numpy's array, scalar and dtype types (and the functions its pickles call to
    rebuild them), taken from numpy's own pickles so that numpy's module layout of
    this version is the one named; () without numpy."""
    try:
        import numpy as np
    except ImportError:
        return ()
    reconstruct = np.zeros(0).__reduce__()[0]  # numpy's _reconstruct
    scalar = np.float64(0).__reduce__()[0]  # numpy's scalar
    dtypes = {type(np.dtype(code)) for code in np.typecodes["All"]}  # np.dtypes' classes
    return (np.ndarray, np.dtype, reconstruct, scalar,
            *sorted(dtypes, key=lambda t: t.__name__))


def allow_client_state_types(*types) -> None:
    """Accept instances of ``types`` (classes, or the functions their pickles call) in
    a ``client_state``, in this process, from now on: at ``save_checkpoint`` and at
    ``load_checkpoint``. Call it on every rank (each rank loads the state itself)
    before both, in the run that saves and in the run that resumes. Allow only types
    whose rebuilding from the file's values runs nothing you would not run."""
    for t in types:
        if not callable(t):
            raise TypeError(f"allow_client_state_types: {t!r} is not a class or function")
        if t not in _ADDED:
            _ADDED.append(t)


def client_state_types() -> tuple:
    """What hybrid accepts beyond weights_only's defaults (the module note), in this
    process: :data:`DEFAULT_TYPES`, numpy's, and :func:`allow_client_state_types`'."""
    return (*DEFAULT_TYPES, *_numpy_types(), *_ADDED)


def _load(data: bytes, extra: tuple = ()):
    with torch.serialization.safe_globals([*client_state_types(), *extra]):
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _dump(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _reason(e: BaseException) -> str:
    """torch's own words on why a weights_only load failed (its message wraps them in
    advice to load with weights_only=False: not for a file of unknown origin)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(e).__name__
    return first.split(" Please use ", 1)[0].split(" was not an allowed global", 1)[0]


def _unsafe(data: bytes) -> list[str]:
    """The globals the pickle in ``data`` names that are not accepted now."""
    with torch.serialization.safe_globals(list(client_state_types())):
        try:
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
        except Exception:  # noqa: BLE001 - not a torch.save file: nothing to name
            return []


def _failure(obj, extra: tuple = ()) -> tuple[str, str, bytes] | None:
    """None when ``obj`` pickles and loads back under the safe loader (``extra`` also
    allowed); else (``"pickle"`` or ``"load"``, why, its bytes when it pickled)."""
    try:
        data = _dump(obj)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises, it cannot be saved
        return "pickle", f"{type(e).__name__}: {e}", b""
    try:
        _load(data, extra)
    except Exception as e:  # noqa: BLE001 - the loader raises several kinds for one refusal
        return "load", _reason(e), data
    return None


def _children(obj, path: str, allowed: tuple) -> Iterator[tuple[str, object]]:
    """(path, value) of what ``obj`` holds, as a loader rebuilds it."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield f"{path}[{k!r}]", v
            yield f"{path} (the key {k!r})", k
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield f"{path}[{i}]", v
    elif isinstance(obj, (set, frozenset)):
        for v in obj:
            yield f"{path} (the member {v!r})", v
    elif type(obj) in allowed and hasattr(obj, "__dict__"):  # a Namespace, an allowed class
        for k, v in vars(obj).items():
            yield f"{path}.{k}", v


def _culprit(obj, path: str) -> tuple[str, object]:
    """The innermost value under ``obj`` (which fails) that fails on its own, and its path."""
    allowed = client_state_types()
    seen: set[int] = set()
    while id(obj) not in seen:  # (a value that holds itself: stop where it repeats)
        seen.add(id(obj))
        for child_path, child in _children(obj, path, allowed):
            if type(child) is not torch.Tensor and _failure(child) is not None:
                obj, path = child, child_path
                break
        else:
            break
    return path, obj


def _resolve(name: str):
    """The object a pickle's global ``name`` (``module.qualname``) names, from the
    modules already imported (nothing is imported for it); None if not found."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is None:
            continue
        obj = module
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _kind(obj) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def encode(client_state: Mapping, where: str = "save_checkpoint(client_state=...)") -> bytes:
    """``client_state`` as the bytes of its file, checked to load back under the safe
    loader (the module notes). ValueError otherwise, naming the value (its path from
    ``client_state``), its type, and how to allow it or what to store instead."""
    if not isinstance(client_state, Mapping):
        raise ValueError(f"{where}: client_state is a dict of the script's values, got "
                         f"{_kind(client_state)}")
    state = dict(client_state)
    whole: tuple[str, str, bytes]
    try:
        data = _dump(state)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises, it cannot be saved
        whole = ("pickle", f"{type(e).__name__}: {e}", b"")
    else:
        try:
            _load(data)
            return data
        except Exception as e:  # noqa: BLE001 - the loader raises several kinds for one refusal
            whole = ("load", _reason(e), data)
    path, obj = _culprit(state, "client_state")
    failed = _failure(obj) or whole
    what = f"{where}: {path} is a {_kind(obj)}"
    if failed[0] == "pickle":
        raise ValueError(f"{what}, which cannot be pickled ({failed[1]}); {_PLAIN}; nothing "
                         f"was written")
    for t, instead in _NOT_REBUILT.items():
        if isinstance(obj, t):
            raise ValueError(f"{what}, which torch's safe loader (torch.load(weights_only="
                             f"True)) cannot rebuild even when allowed (it fills only lists "
                             f"and dicts): store it as {instead}; nothing was written")
    names = _unsafe(failed[2])
    found = [_resolve(n) for n in names]
    if names and all(f is not None for f in found) and _failure(obj, tuple(found)) is None:
        spelled = ", ".join(n.removeprefix("__main__.") for n in names)
        needs = "" if names == [f"{type(obj).__module__}.{type(obj).__qualname__}"] else (
            f" (its pickle names {spelled})")
        raise ValueError(f"{what}, which hybrid's safe loader does not accept{needs}: to "
                         f"accept it, {_HOW.format(names=spelled)}; or {_PLAIN}; nothing "
                         f"was written")
    raise ValueError(f"{what}, which torch's safe loader (torch.load(weights_only=True)) "
                     f"cannot rebuild{' even when allowed' if names else ''} ({failed[1]}); "
                     f"{_PLAIN}; nothing was written")


def decode(data: bytes, path: str) -> dict:
    """The client_state in ``data``, the bytes of the file ``path`` (already checked
    against the checkpoint's checksum), loaded safely with tensors on the CPU.
    CheckpointError naming ``path``: the types to allow when the file names a type
    this process does not accept, else that the file is corrupt."""
    try:
        state = _load(data)
    except Exception as e:  # noqa: BLE001 - any unreadable state is one error naming the file
        names = _unsafe(data)
        if names:
            spelled = ", ".join(n.removeprefix("__main__.") for n in names)
            raise CheckpointError(
                f"{path}: the client_state saved there holds {spelled}, which hybrid's safe "
                f"loader does not accept in this process: "
                f"{_HOW.format(names=spelled)}, as the saving run did") from None
        raise CheckpointError(f"{path}: corrupt or truncated client_state file (not "
                              f"loadable: {_reason(e)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: corrupt client_state file (it holds a "
                              f"{_kind(state)}, not a dict)")
    return state


__all__ = ["DEFAULT_TYPES", "FILE", "allow_client_state_types", "client_state_types", "decode",
           "encode"]
