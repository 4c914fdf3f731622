"""The offload tiers' families keep their contracts, and the ZeRO core stays below offload.

Each Protocol of hybrid/zero/offload/contracts.py names what every member of a
family must have; a member that drops a method, renames a parameter or adds a
required one fails here, at import speed, before any run would reach it. A type
checker holds the same classes to the Protocols' annotations (the typed
assignments at the bottom).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import typing
from typing import Any

import pytest

from hybrid.zero import flat_unit, grad_sync
from hybrid.zero.gather_pipeline import ShardPublisher
from hybrid.zero.grad_sync import DeviceShard
from hybrid.zero.offload import contracts
from hybrid.zero.offload.grads import HostGrads
from hybrid.zero.offload.homes import HostHome
from hybrid.zero.offload.landing import CopyDown, GradLanding
from hybrid.zero.offload.nvme.adamw import SwappedAdamW
from hybrid.zero.offload.nvme.grads import SwappedGrads
from hybrid.zero.offload.nvme.homes import DiskHome, GdsHome
from hybrid.zero.offload.nvme.speculative import SpeculativeUpdate
from hybrid.zero.optimizer import ShardedAdamW

ZERO = pathlib.Path(flat_unit.__file__).parent

FAMILIES: dict[type, list[Any]] = {
    contracts.ShardOptimizer: [ShardedAdamW, SwappedAdamW],
    contracts.GradStore: [HostGrads, SwappedGrads],
    contracts.ParamHome: [HostHome, DiskHome, GdsHome],
    flat_unit.ShardHome: [HostHome, DiskHome, GdsHome],
    contracts.ParamPublisher: [ShardPublisher],
    contracts.Speculation: [SpeculativeUpdate],
    grad_sync.GradSink: [DeviceShard, CopyDown, GradLanding],
}


def _members(proto) -> dict[str, Any]:
    """The Protocol's own members and its bases' (methods and properties)."""
    out: dict[str, Any] = {}
    for base in reversed(proto.__mro__):
        if base is typing.Protocol or base is typing.Generic or base is object:
            continue
        if not getattr(base, "_is_protocol", False):
            continue
        for name, value in vars(base).items():
            if not name.startswith("_") and (callable(value) or isinstance(value, property)):
                out[name] = value
    return out


def _params(fn) -> list[tuple[str, object, bool]]:
    """(name, kind, has a default) of each parameter after ``self``."""
    if isinstance(fn, staticmethod):
        fn = fn.__func__
        skip = 0
    else:
        skip = 1
    ps = list(inspect.signature(fn).parameters.values())[skip:]
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in ps]


@pytest.mark.parametrize("proto", list(FAMILIES), ids=lambda p: p.__name__)
def test_every_family_member_has_the_protocol_s_methods(proto):
    """Every method of the Protocol exists on each member with the same parameters
    (names, kinds, which have defaults); every property is a property, a class
    attribute or set in the member's constructor."""
    members = _members(proto)
    assert members, proto
    wrong = []
    for cls in FAMILIES[proto]:
        init = inspect.getsource(cls.__init__) + "".join(
            inspect.getsource(b.__init__) for b in cls.__mro__[1:]
            if b is not object and "__init__" in vars(b))
        for name, want in members.items():
            have = inspect.getattr_static(cls, name, None)
            if isinstance(want, property):
                attribute = have is not None and not callable(have)
                if not attribute and f"self.{name}" not in init:
                    wrong.append(f"{cls.__name__}.{name}: not a property nor set in __init__")
                continue
            if have is None or not callable(getattr(cls, name)):
                wrong.append(f"{cls.__name__}.{name}: missing")
                continue
            if _params(have) != _params(want):
                wrong.append(f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} "
                             f"is not {proto.__name__}.{name}{inspect.signature(want)}")
    assert not wrong, "\n".join(wrong)


def test_the_check_above_can_fail():
    """A member without a method, or with a parameter renamed, is named."""
    class Short:
        def prefetch(self) -> None: ...

        def load_into(self, dst) -> None: ...

    members = _members(flat_unit.ShardHome)
    assert set(members) == {"prefetch", "load_into", "values", "store"}
    assert inspect.getattr_static(Short, "values", None) is None
    assert _params(vars(Short)["load_into"]) != _params(members["load_into"])


def _zero_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_zero_core_does_not_import_offload():
    """Only the engine composes the offload tiers; the core's modules (units, buckets,
    reducer, gathers, optimizer, scaler, state, plan) never import them, so offload
    may import any of them without a circle."""
    composers = {"engine.py"}
    wrong = [f"{p.name} imports {m}" for p in sorted(ZERO.glob("*.py"))
             if p.name not in composers
             for m in _zero_imports(p) if m.startswith("hybrid.zero.offload")]
    assert not wrong, wrong


def test_the_host_step_never_asks_which_tier():
    """Of the offload modules beside the tiers, only ``tiers.py`` (which builds them)
    imports the nvme tier: the host step, the gradient stores, the homes and the writer
    hold a tier's objects through the contracts alone (the tiers decide the nvme
    tier's speculative update and hands the host step a maker of it)."""
    offload = ZERO / "offload"
    wrong = [f"{p.name} imports {m}" for p in sorted(offload.glob("*.py"))
             if p.name != "tiers.py"
             for m in _zero_imports(p) if m.startswith("hybrid.zero.offload.nvme")]
    assert not wrong, wrong


if typing.TYPE_CHECKING:  # what a type checker holds the families to
    def _families(sharded: ShardedAdamW, swapped: SwappedAdamW, host_grads: HostGrads,
                  swapped_grads: SwappedGrads, host: HostHome, disk: DiskHome,
                  gds: GdsHome, publisher: ShardPublisher, device: DeviceShard,
                  down: CopyDown, landing: GradLanding,
                  speculative: SpeculativeUpdate) -> None:
        optimizers: list[contracts.ShardOptimizer] = [sharded, swapped]
        stores: list[contracts.GradStore] = [host_grads, swapped_grads]
        homes: list[contracts.ParamHome] = [host, disk, gds]
        publishers: list[contracts.ParamPublisher] = [publisher]
        sinks: list[grad_sync.GradSink] = [device, down, landing]
        speculations: list[contracts.Speculation] = [speculative]
        del optimizers, stores, homes, publishers, sinks, speculations
