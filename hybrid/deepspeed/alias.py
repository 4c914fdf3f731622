"""``deepspeed`` and each ``deepspeed.*`` module served by :mod:`hybrid.deepspeed`, in one
process: how a DeepSpeed script runs with no line changed.

    python -m hybrid.deepspeed.alias [--module] [--no_local_rank] train.py ARGS...

is what each worker of :mod:`hybrid.deepspeed.launcher` runs (torchrun sets the ranks):
it installs :class:`DeepSpeedAlias` at the front of ``sys.meta_path``, puts
``--local_rank=N`` after the script's name as DeepSpeed's launcher does, and runs the
script as ``__main__``. ``import deepspeed``, ``from deepspeed.pipe import
PipelineModule`` and ``from deepspeed.utils import RepeatingLoader`` then import
``hybrid.deepspeed``, ``hybrid.deepspeed.pipe`` and ``hybrid.deepspeed.utils``; a
DeepSpeed installed beside hybrid is never imported in that process (and nothing changes
in any other). A ``deepspeed.X`` hybrid does not serve is a ModuleNotFoundError with
hybrid's own words: what to use instead, never a bare "No module named".

[Note: the alias is the same module object]
``sys.modules["deepspeed.pipe"]`` is ``hybrid.deepspeed.pipe`` itself, not a copy, so a
class checked with ``isinstance`` against either name is one class, and state a
module keeps (the engine's registry, ``checkpointing.configure``) is kept once. The
import system writes the alias's spec onto the module it is given; the module's own
spec is put back, so ``hybrid.deepspeed.pipe.__spec__`` still names itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence
from types import ModuleType

ALIASED = "deepspeed"
OURS = "hybrid.deepspeed"


def not_served(fullname: str) -> str:
    """hybrid's words for ``deepspeed.X...`` that it does not serve."""
    from hybrid.deepspeed import _NOT_HERE
    from hybrid.deepspeed.missing import advice

    dotted = fullname.split(".", 1)[1] if "." in fullname else fullname
    why = advice(dotted) or _NOT_HERE.get(
        dotted.split(".")[0], "it is not one of the DeepSpeed modules hybrid serves yet")
    return (f"No module named {fullname!r} under hybrid (this process runs DeepSpeed's names "
            f"on hybrid.deepspeed): {why}; docs/deepspeed.md lists what it serves")


class DeepSpeedAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder and loader for ``deepspeed`` and ``deepspeed.*``: each name is the module of
    the same name under ``hybrid.deepspeed`` (the Note above)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIASED and not fullname.startswith(ALIASED + "."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        ours = f"hybrid.{spec.name}"
        try:
            module = importlib.import_module(ours)
        except ModuleNotFoundError as e:
            if e.name is not None and (ours == e.name or ours.startswith(e.name + ".")):
                raise ModuleNotFoundError(not_served(spec.name), name=spec.name) from None
            raise
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # already run under its own name; the import system wrote the alias's spec on it
        module.__spec__ = self._specs.pop(module.__spec__.name if module.__spec__ else "",
                                          module.__spec__)

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}


def install() -> DeepSpeedAlias:
    """Serve ``deepspeed`` from hybrid in this process, ahead of any installed DeepSpeed.
    A ``deepspeed`` imported before is an error: the two would be mixed."""
    there = [m for m in sys.modules if m == ALIASED or m.startswith(ALIASED + ".")]
    if there:
        raise RuntimeError(f"DeepSpeed's own modules are already imported ({there[0]}): "
                           f"install the alias before the script runs")
    alias = DeepSpeedAlias()
    sys.meta_path.insert(0, alias)
    return alias


def main(argv: list[str] | None = None) -> None:
    """Run one worker's script (module docstring); ``argv``: ``[--module] [--no_local_rank]
    SCRIPT ARGS...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    as_module = no_local_rank = False
    while args and args[0] in ("--module", "--no_local_rank"):
        flag = args.pop(0)
        as_module |= flag == "--module"
        no_local_rank |= flag == "--no_local_rank"
    if not args:
        raise SystemExit("usage: python -m hybrid.deepspeed.alias [--module] "
                         "[--no_local_rank] SCRIPT [ARGS...]")
    script, rest = args[0], args[1:]
    if not no_local_rank:  # DeepSpeed's launcher passes it first, before the script's own
        rest = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *rest]
    install()
    sys.argv = [script, *rest]
    if as_module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` does
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
