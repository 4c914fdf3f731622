"""DeepSpeed's two ZeRO-3 context managers for a user's own model.

    torch.manual_seed(1234)                        # the same on every rank
    with hybrid.zero_init():                       # deepspeed.zero.Init
        model = AutoModelForCausalLM.from_config(cfg)   # each rank keeps its part only
    engine, *_ = hybrid.initialize(model=model, config=ds)  # the engine takes the parts

    with hybrid.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        model.lm_head.weight.zero_()               # full values inside; rank 0's kept

A model built under :func:`zero_init` keeps what its constructors wrote, and no rank
holds it whole (:mod:`hybrid.engine.zero_build`, [Note: building under zero_init]);
``initialize`` takes the parts: :func:`take_parts` makes the cut parameters meta
again, and :class:`BuiltValues` gathers each once and keeps what the engine's layout
asks of the rank.

[Note: drawing a shard of a model built on meta]
A model built on the meta device (``with torch.device("meta"):``, or parameters
made with ``device="meta"``) has no values to keep. :class:`ModuleInitValues`
gives the engine the values of any element range of such a parameter: it
materializes the *module that owns the parameter* (its own parameters only, on
the CPU), runs that module's initializer -- the model's ``_init_weights``
(``transformers``) or the module's ``reset_parameters`` -- under a generator
seeded from the run seed and the parameter's name, and hands out slices. So
every rank draws the same values without communicating, and a rank holds at
most its shard plus one module's parameters at a time (a leaf: one Linear's
weight and bias). What a parent module's initializer would add (GPT-2 rescales
its residual projections from the attention module) is not applied: each
parameter gets its own module's initializer.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybrid.engine.zero_build import (
    Build,
    CutParameter,
    Part,
    active as building_now,
    all_gather_single,
    building,
    gathered,
    is_cut,
)
from hybrid.errors import ConfigError
from hybrid.zero.units import read_values

if TYPE_CHECKING:
    import torch.distributed as dist

    from hybrid.parallel.comm import CommGroup
    from hybrid.parallel.state import ParallelState
    from hybrid.zero.flat_unit import FlatUnit
    from hybrid.zero.units import ValueSource


@contextlib.contextmanager
def zero_init(group: dist.ProcessGroup | CommGroup | None = None) -> Iterator[None]:
    """Modules built inside keep what their constructors write, and each rank keeps only
    its part of every parameter once the module's constructor has returned
    (DeepSpeed's ``zero.Init``; [Note: building under zero_init] in
    :mod:`hybrid.engine.zero_build`): :func:`hybrid.initialize` takes the parts.

    Every rank draws the whole of each parameter from torch's global generator, as a
    plain build would: seed every rank the same before building (``initialize``
    refuses ranks that drew differently). ``group``: the ranks that share the
    parameters, the engine's data-parallel ranks (a torch ProcessGroup or hybrid's
    CommGroup; default: torch.distributed's world). Without torch.distributed (one
    process) the model is built as usual. Buffers are never cut."""
    with building(group):
        yield


class ModuleInitValues:
    """``values(name, param, lo, hi)`` for the engine of a model built on the meta
    device (see the module note)."""

    def __init__(self, model: nn.Module, seed: int):
        self.model, self.seed = model, seed
        self.owner: dict[int, tuple[nn.Module, str]] = {}  # id(param) -> (module, name)
        for module in model.modules():
            for pname, p in module.named_parameters(recurse=False):
                self.owner.setdefault(id(p), (module, pname))
        self._cached: tuple[str, torch.Tensor] | None = None
        self.largest = 0  # elements of the largest module materialized (for tests)

    def __call__(self, name: str, param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != name:
            self._cached = (name, self._draw(name, param))
        return self._cached[1].reshape(-1)[lo:hi]

    @torch.no_grad()
    def _draw(self, name: str, param: torch.Tensor) -> torch.Tensor:
        module, pname = self.owner[id(param)]
        local = copy.deepcopy(module)  # (meta: no memory) its own parameters only
        for child in list(local._modules):
            local._modules[child] = None
        local = local.to_empty(device="cpu")
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int.from_bytes(digest[:8], "little") % (2 ** 63))
            init = getattr(self.model, "_init_weights", None)
            reset = getattr(local, "reset_parameters", None)
            if init is not None:
                init(local)
            elif reset is not None:
                reset()
            else:
                raise ValueError(f"hybrid.initialize: cannot draw {name} of a model built "
                                 f"on the meta device: {type(module).__name__} has no "
                                 f"reset_parameters() and the model no _init_weights()")
        self.largest = max(self.largest, sum(p.numel() for p in local.parameters()))
        return getattr(local, pname).detach().float()


def take_parts(model: nn.Module) -> dict[int, Part]:
    """Every cut parameter of ``model`` becomes a meta ``nn.Parameter`` again (the engine
    materializes those); returns their parts by ``id(param)``."""
    parts: dict[int, Part] = {}
    for p in list(model.parameters()):
        if not isinstance(p, CutParameter):
            continue
        part = p._part
        if part.held:
            raise RuntimeError("hybrid.initialize inside a GatheredParameters block of the "
                               "model it is given: initialize after the block")
        part.put_away()
        meta = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                            requires_grad=p.requires_grad)
        meta.__dict__.update({k: v for k, v in p.__dict__.items()
                              if k not in ("_part", "_meta", "_is_param")})
        torch.utils.swap_tensors(p, meta)
        parts[id(p)] = part
    return parts


class BuiltValues:
    """``values(name, param, lo, hi)`` for the engine of a model built under
    ``zero_init()``: the values its constructors left (:meth:`prepare` collects them).
    A parameter that was not cut takes ``fallback``'s."""

    def __init__(self, model: nn.Module, parts: dict[int, Part], dp_ranks: list[int],
                 device: torch.device, fallback: ValueSource):
        self.model, self.parts, self.dp_ranks = model, parts, list(dp_ranks)
        self.device, self.fallback = device, fallback
        self.pieces: dict[int, list[tuple[int, int, torch.Tensor]]] = {}

    def prepare(self, units: list[FlatUnit]) -> None:
        """Collective over the build's ranks, before any value is read: each parameter is
        gathered once, in the model's order, and this rank keeps the ranges ``units``
        (the engine's layout) make it fill -- a partitioned unit's own shard, a whole
        unit's parameters whole. A parameter the engine does not train comes back whole
        on ``device``."""
        need: dict[int, list[tuple[int, int]]] = {}
        for u in units:
            if u.partition_params:
                for i, plo, _, n in u.segments(u.own_lo, u.own_hi):
                    need.setdefault(id(u.params[i]), []).append((plo, plo + n))
            else:
                for p in u.params:
                    need.setdefault(id(p), []).append((0, p.numel()))
        order = [p for p in self.model.parameters() if id(p) in self.parts]
        builds = list({id(self.parts[id(p)].build): self.parts[id(p)].build
                       for p in order}.values())
        for build in builds:
            _check_build(build, self.dp_ranks)
        for p in order:
            part = self.parts.pop(id(p))
            whole = part.build.gather(part)
            if id(p) not in need:
                _make_real(p, whole.view(p.shape).to(self.device))
                continue
            self.pieces[id(p)] = [(lo, hi, whole[lo:hi].clone())
                                  for lo, hi in _merged(need[id(p)])]

    def __call__(self, name: str, param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        pieces = self.pieces.get(id(param))
        if pieces is None:
            return self.fallback(name, param, lo, hi)
        for a, b, t in pieces:
            if a <= lo and hi <= b:
                return t[lo - a: hi - a].float()
        raise AssertionError(f"{name}: elements [{lo}, {hi}) were not prepared")


def _check_build(build: Build, dp_ranks: list[int]) -> None:
    """The build's ranks are the engine's DP ranks, and drew alike (collective)."""
    if sorted(build.ranks) != sorted(dp_ranks):
        raise ConfigError(f"hybrid.initialize: the model was built under zero_init() over "
                          f"ranks {build.ranks}, and the engine's data-parallel group is "
                          f"{dp_ranks}: build it under zero_init(group=...) (deepspeed.zero."
                          f"Init(data_parallel_group=...)) with the data-parallel group")
    mine = torch.tensor(list(build.digest.digest()), dtype=torch.uint8,
                        device=build.comm_device)
    every = torch.empty(build.size * mine.numel(), dtype=torch.uint8, device=build.comm_device)
    all_gather_single(every, mine, group=build.group)
    rows = every.view(build.size, -1).cpu()
    if not bool((rows == rows[0]).all()):
        raise ConfigError("hybrid.initialize: the ranks built the model under zero_init() "
                          "from different random states, so their parts of the parameters "
                          "do not agree: seed every rank the same (torch.manual_seed) before "
                          "building, and draw on all ranks or inside GatheredParameters("
                          "..., modifier_rank=...)")


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _make_real(p: nn.Parameter, values: torch.Tensor) -> None:
    """Make ``values`` the data of the meta parameter ``p`` (the same object)."""
    new = nn.Parameter(values, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)
    torch.utils.swap_tensors(p, new)


def init_values(model: nn.Module, seed: int, parts: dict[int, Part], ps: ParallelState
                ) -> ModuleInitValues | BuiltValues:
    """The engine's ``values`` for a model with meta parameters: the parts
    :func:`zero_init` cut (``parts``, from :func:`take_parts`; gathered once over the
    build's ranks, which must be ``ps``'s data-parallel ranks), each other meta
    parameter drawn by :class:`ModuleInitValues`, a real one read."""
    drawn = ModuleInitValues(model, seed)
    if not parts:
        return drawn

    def rest(name: str, param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return drawn(name, param, lo, hi) if param.is_meta else read_values(name, param, lo, hi)
    return BuiltValues(model, parts, ps.dp_cp_group.ranks, ps.device, rest)


@contextlib.contextmanager
def GatheredParameters(params: torch.Tensor | Iterable[torch.Tensor],
                       modifier_rank: int | None = None, enabled: bool = True) -> Iterator[None]:
    """Full parameter values inside the block (stage 3 gathers them; other stages hold
    them anyway). With ``modifier_rank``, that DP rank's values of ``params`` afterwards
    become every rank's, and the fp32 master (so training goes on from them).

    Before ``initialize``, on a model being built or built under :func:`zero_init`: the
    parts are gathered for the block, and with ``modifier_rank`` that rank's values are
    every rank's afterwards (inside a build every rank also goes on from that rank's
    random state: it may have drawn alone). Without it each rank keeps what it wrote."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    engine = getattr(params[0], "hybrid_engine", None) if params else None
    if not enabled or (engine is None and not (building_now() or any(map(is_cut, params)))):
        yield  # not under a hybrid engine nor a build: nothing is sharded
        return
    if engine is None:
        with gathered(params, modifier_rank):
            yield
        return
    from hybrid.zero.state import write_master_from_params
    with engine.zero.gathered():
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for p in params:
                    engine.ps.dp_group.broadcast(p.data, src=modifier_rank)
            write_master_from_params(engine.zero, params)
