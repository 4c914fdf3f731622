"""``deepspeed.utils``' leaf modules: a module ZeRO stage 3 gathers as one unit, with
everything under it (:func:`hybrid.engine.build.gather_whole`), so a mixture-of-experts
layer whose router picks experts per token never waits on a per-expert gather.

In hybrid stage 3 already gathers whole blocks (each transformer layer); a leaf inside a
block changes nothing, and a leaf holding blocks is gathered in their place. Marks are
read when ``initialize`` builds the engine, as DeepSpeed reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hybrid.engine.build import gather_whole, gathered_whole

__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "z3_leaf_module"]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked a leaf."""
    return gathered_whole(model)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The marked modules under ``model`` (itself included), in ``modules()`` order."""
    return [m for m in model.modules() if gathered_whole(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (``flag`` true) or unmark ``model`` itself."""
    gather_whole(model, flag)


def _matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark(model: nn.Module, classes: Sequence[type | str], flag: bool,
          raise_if_not_found: bool) -> list[nn.Module]:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"set_z3_leaf_modules: leaf_module_classes holds classes or class "
                        f"names, not {bad}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    if not found and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"set_z3_leaf_modules: no module of the classes {names} in the "
                         f"model ({type(model).__name__})")
    for m in found:
        gather_whole(m, flag)
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of ``leaf_module_classes`` (classes, or their names, plain or
    qualified with the module) under ``model``; returns them. None found: ValueError,
    unless ``raise_if_not_found`` is false."""
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Unmark them (:func:`set_z3_leaf_modules`'s reverse)."""
    return _mark(model, leaf_module_classes, False, raise_if_not_found)
