"""How ZeRO lays a model out: which parameters form each unit, and making them real.

A unit (:class:`FlatUnit`) is what ZeRO communicates as one. Stages 0-2 pack
parameters, last first (their gradients are ready first), into units of at
most a reduce bucket. Stage 3 makes one partitioned unit per module it gathers
as a whole (each transformer block), one for what no block owns (the root
module), and buckets of the small parameters that stay whole
(``param_persistence_threshold``).

[Note: shared parameters]
A parameter registered under several names (one weight used by two blocks)
gets gradient contributions from several places, and under recompute each
checkpointed block runs its own nested backward, so its post-accumulate hook
fires once per use. No hook can tell when its gradient is complete. Such
parameters go into *deferred* units, reduced once when backward has finished.
At stage 3 they join the root unit, which stays gathered through the whole
forward and the whole backward, so every block that uses them finds them
whole.

[Note: expert units]
An MoE layer's experts split over the EP group (parameters marked ``ep_spec``) are held
by the ranks of the expert data-parallel group (``ps.edp_group``), not by every DP rank:
they go into units of their own over that group, so their gradients are reduced, their
shards kept and their parameters gathered there. A stage-3 MoE block is then two units,
its dense part over DP x CP and its experts over EDP, gathered around the same run. The
mean is over the DP size for both ([Note: gradient precision] in grad_sync.py): each
expert's gradient sums the tokens every DP rank sent it. At EP 1 the experts are dense
parameters like the rest.

[Note: a unit of its own]
A parameter named in ``alone`` gets a unit holding it and nothing else: the
same size and the same DP partition on every rank that holds a copy of it,
whatever else each rank holds. Two pipeline stages' copies of a tied word
embedding are then summed shard against shard (element ``k`` of one rank's
gradient shard is element ``k`` of the other's). Such units come first, so each
starts the rank's flat shard at offset 0 on every such rank: an update kernel
whose rounding depends on an element's place in the call still treats the
copies alike. At stage 3 a large one is partitioned and gathered around the
whole model's run, like the root unit.

[Note: materializing only what a rank keeps]
Parameters may arrive on the meta device. ``values(name, param, lo, hi)``
supplies fp32 values of a TP-local flat range (the block-seeded init of
:mod:`hybrid.tensor_parallel.init`, the parts a ``zero_init()`` build left, or a
real parameter's own data). Units are
filled chunk by chunk from it: a partitioned unit only its own shard, the
fp32 master only this rank's ranges. So no rank ever holds more than it keeps.

[Note: frozen units]
At stage 3 a frozen parameter (``requires_grad`` False: the pretrained base under a
LoRA adapter) is partitioned like a trainable one, as DeepSpeed's ZeRO-3 does, so no
rank holds a frozen base whole. It goes into a *frozen unit* (:func:`plan_frozen_units`)
of its own module (a block's frozen parameters one unit beside its trainable one; what
no block owns, and a frozen parameter registered under several names, the root
module's): a partitioned :class:`FlatUnit` like any other, gathered by the same hooks
before the module's forward and again for its backward (its weights compute the
gradient of the module's input), and released after each. It is in none of the
engine's ``units``: no gradient is reduced for it, the optimizer has no piece of it, and
there is no fp32 master: its shard in the training dtype is the value (fp32 values are
read once, from the value source, at construction). What releases it after backward
is not the reducer (it has no gradient to pack) but its module's input gradients
being complete (hybrid/zero/param_sync.py, [Note: releasing a frozen unit]). A frozen
parameter under ``param_persistence_threshold`` stays whole, as a small trainable one
does, and so does one that is not floating point. Decided once at construction, at
stage 3 only (other stages keep every parameter whole) and not for a model in parts
(an interleaved pipeline's chunks: its frozen parameters stay whole). Under
``--offload-param`` a frozen unit's shard lives off the device in a parameter home like
a trainable unit's (hybrid/zero/offload/tiers.py, [Note: frozen units at home]).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from hybrid.config.sections import ZeroConfig
from hybrid.parallel.comm import CommGroup
from hybrid.parallel.state import ParallelState
from hybrid.zero.flat_unit import FlatUnit
from hybrid.zero.plan import ShardingPlan

FILL_CHUNK = 1 << 22  # elements drawn at once while materializing

# ``values(name, param, lo, hi)``: fp32 values of a TP-local flat range ([Note:
# materializing only what a rank keeps])
ValueSource = Callable[[str, torch.Tensor, int, int], torch.Tensor]
# ``fill(lo, hi, dst)``: ``dst`` <- elements ``[lo, hi)`` of the rank's flat shard
FlatFill = Callable[[int, int, torch.Tensor], None]


def shared_param_ids(model: nn.Module) -> set[int]:
    """Parameters registered under more than one name."""
    count: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        count[id(p)] = count.get(id(p), 0) + 1
    return {k for k, c in count.items() if c > 1}


def is_expert(p: torch.Tensor) -> bool:
    """An MoE layer's experts split over the EP group (``ep_spec``): reduced and sharded
    over the expert data-parallel group ([Note: expert units])."""
    return getattr(p, "ep_spec", None) is not None


def by_group(params: Sequence[nn.Parameter], ps: ParallelState
             ) -> list[tuple[list[nn.Parameter], CommGroup]]:
    """``params`` as (dense, DP x CP) and (experts, EDP), in order, the empty one left
    out; at EP 1 all of them over DP x CP ([Note: expert units])."""
    if not ps.experts_split:
        return [(list(params), ps.dp_cp_group)] if params else []
    dense = [p for p in params if not is_expert(p)]
    experts = [p for p in params if is_expert(p)]
    return [(g, group) for g, group in ((dense, ps.dp_cp_group), (experts, ps.edp_group))
            if g]


def bucket_units(params: Sequence[nn.Parameter], ps: ParallelState, bucket: int,
                 owns_all: bool, tag: str, deferred: bool = False) -> list[FlatUnit]:
    """Pack params, last first, into units of at most ``bucket`` elements (one
    larger parameter makes a unit of its own); an MoE layer's experts in units of their
    own, over the expert data-parallel group ([Note: expert units])."""
    out: list[FlatUnit] = []
    for some, group in by_group(params, ps):
        name = tag if group is ps.dp_cp_group else f"{tag}_experts"
        out += _buckets(some, group, bucket, owns_all, name, deferred)
    return out


def _buckets(params: Sequence[nn.Parameter], group: CommGroup, bucket: int, owns_all: bool,
             tag: str, deferred: bool) -> list[FlatUnit]:
    groups: list[list[nn.Parameter]] = []
    cur: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        if cur and size + p.numel() > bucket:
            groups.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    if cur:
        groups.append(cur)
    return [FlatUnit(g, group, owns_all=owns_all, deferred=deferred, name=f"{tag}{i}")
            for i, g in enumerate(groups)]


def plan_units(model: nn.Module, ps: ParallelState, cfg: ZeroConfig, plan: ShardingPlan,
               unit_modules: Iterable[nn.Module] | None, alone: Collection[str] = ()
               ) -> tuple[list[FlatUnit], list[tuple[nn.Module, FlatUnit]]]:
    """(units, owners): every trainable parameter in exactly one unit; ``owners`` are
    the (module, partitioned unit) pairs stage 3 gathers around each module's run.
    ``alone``: names of parameters that get a unit of their own each, first in
    ``units`` ([Note: a unit of its own])."""
    named = dict(model.named_parameters())
    solo = [(n, named[n]) for n in alone if named[n].requires_grad]
    solo_ids = {id(p) for _, p in solo}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in solo_ids]
    shared = shared_param_ids(model)
    if not plan.params:
        plain = [p for p in params if id(p) not in shared]
        multi = [p for p in params if id(p) in shared]
        return ([FlatUnit([p], ps.dp_cp_group, owns_all=not plan.optimizer,
                          deferred=id(p) in shared, name=n) for n, p in solo]
                + bucket_units(plain, ps, cfg.reduce_bucket_size, not plan.optimizer, "bucket")
                + bucket_units(multi, ps, cfg.reduce_bucket_size, not plan.optimizer,
                               "shared", deferred=True)), []
    thr = cfg.param_persistence_threshold
    # a small one stays whole like the persistent buckets, a large one is partitioned
    lone = [FlatUnit([p], ps.dp_cp_group, partition_params=p.numel() >= thr,
                     deferred=id(p) in shared, name=n) for n, p in solo]
    small = [p for p in params if p.numel() < thr]
    units = (bucket_units([p for p in small if id(p) not in shared], ps,
                          cfg.reduce_bucket_size, False, "persistent")
             + bucket_units([p for p in small if id(p) in shared], ps,
                            cfg.reduce_bucket_size, False, "persistent_shared", deferred=True))
    taken: set[int] = set()
    owners = []
    for i, m in enumerate(unit_modules or []):
        mine = [p for p in m.parameters() if p.requires_grad and p.numel() >= thr
                and id(p) not in shared and id(p) not in taken and id(p) not in solo_ids]
        taken.update(id(p) for p in mine)
        for some, group in by_group(mine, ps):  # (an MoE block: its experts apart)
            name = f"module{i}" if group is ps.dp_cp_group else f"module{i}_experts"
            owners.append((m, FlatUnit(some, group, partition_params=True, name=name)))
    rest = [p for p in params if id(p) not in taken and p.numel() >= thr]
    # the root module's units, gathered from its forward to the end of its backward:
    # what no block owns, then the partitioned units of their own
    top = [(model, u) for u in lone if u.partition_params]
    for k, (some, group) in enumerate(by_group(rest, ps)):
        top.insert(k, (model, FlatUnit(some, group, partition_params=True,
                                       deferred=any(id(p) in shared for p in some),
                                       name="root" if group is ps.dp_cp_group
                                       else "root_experts")))
    owners = top + owners
    return lone + units + [u for _, u in owners if u not in lone], owners


def is_partitionable_frozen(p: torch.Tensor) -> bool:
    """A frozen parameter stage 3 may partition ([Note: frozen units])."""
    return not p.requires_grad and p.is_floating_point()


def plan_frozen_units(model: nn.Module, ps: ParallelState, cfg: ZeroConfig,
                      plan: ShardingPlan, unit_modules: Iterable[nn.Module] | None
                      ) -> list[tuple[nn.Module, FlatUnit]]:
    """Stage 3's frozen units as (owner module, unit): each unit module's frozen
    parameters of at least ``param_persistence_threshold`` elements, then the root
    module's (what no unit module owns, and frozen parameters registered under several
    names); an MoE layer's experts apart, over their group ([Note: frozen units]).
    Empty below stage 3."""
    if not plan.params:
        return []
    thr = cfg.param_persistence_threshold
    shared = shared_param_ids(model)
    frozen = [p for p in model.parameters()
              if is_partitionable_frozen(p) and p.numel() >= thr]
    ids = {id(p) for p in frozen}
    taken: set[int] = set()
    out: list[tuple[nn.Module, FlatUnit]] = []
    for i, m in enumerate(unit_modules or []):
        mine = [p for p in m.parameters() if id(p) in ids and id(p) not in shared
                and id(p) not in taken]
        taken.update(id(p) for p in mine)
        for some, group in by_group(mine, ps):
            name = f"frozen{i}" if group is ps.dp_cp_group else f"frozen{i}_experts"
            out.append((m, FlatUnit(some, group, partition_params=True, name=name)))
    rest = [p for p in frozen if id(p) not in taken]
    root = [(model, FlatUnit(some, group, partition_params=True,
                             name="frozen_root" if group is ps.dp_cp_group
                             else "frozen_root_experts"))
            for some, group in by_group(rest, ps)]
    return root + out


class OwnedPiece(NamedTuple):
    """One parameter's piece of a rank's owned shard (:meth:`ZeroEngine.owned_pieces`).

    ``name``, ``param``: the parameter (its first name in ``model.named_parameters()``).
    ``lo``, ``hi``: the piece is elements ``[lo, hi)`` of the TP-local parameter
    flattened -- the same whatever the stage, bucket size or DP size.
    ``unit``: the index of its unit in ``engine.units``, and of that unit's part in
    every per-unit list of the optimizer (``master``, ``exp_avg``, ``exp_avg_sq``).
    ``part``: where the piece lies in its unit's owned part: ``unit.shard[part]``,
    ``unit.grad_shard[part]`` and ``optimizer.master[unit][part]`` are its values.
    """

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    unit: int
    part: slice

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def owned_pieces(model: nn.Module, units: list[FlatUnit]) -> tuple[OwnedPiece, ...]:
    """Every piece of ``units``' owned ranges, unit by unit and in unit order within
    each (the order of the rank's flat shard); padding belongs to no piece."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for k, u in enumerate(units):
        for i, plo, ulo, n in u.segments(u.own_lo, u.own_hi):
            a = ulo - u.own_lo
            out.append(OwnedPiece(name=names[id(u.params[i])], param=u.params[i], lo=plo,
                                  hi=plo + n, unit=k, part=slice(a, a + n)))
    return tuple(out)


def read_values(name: str, param: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The value source of a model whose parameters are already materialized."""
    return param.detach().reshape(-1)[lo:hi].float()


class Materializer:
    """Fills unit storage and master shards from ``values``, a bounded chunk at a time.

    A ``values`` with a ``prepare(units)`` method has it called here, on every rank,
    before any value is read: a source that must communicate to serve the ranges the
    layout ``units`` asks of this rank (a model built under ``zero_init()``, whose ranks
    each hold a part of every parameter) does so once, collectively."""

    def __init__(self, model: nn.Module, values: ValueSource | None,
                 units: list[FlatUnit] | None = None):
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.values = values or read_values
        prepare = getattr(values, "prepare", None)
        if prepare is not None:
            prepare(units or [])

    @torch.no_grad()
    def fill(self, p: torch.Tensor, lo: int, hi: int, dst: torch.Tensor) -> None:
        """``dst`` (``(hi - lo,)``, any dtype/device) <- values of ``p``'s range [lo, hi)."""
        name = self.names[id(p)]
        for a in range(lo, hi, FILL_CHUNK):
            b = min(hi, a + FILL_CHUNK)
            dst[a - lo: b - lo].copy_(self.values(name, p, a, b))

    def flat_filler(self, pieces: Sequence[OwnedPiece], units: list[FlatUnit]) -> FlatFill:
        """``fill(lo, hi, dst)``: ``dst`` <- the exact fp32 values of elements ``[lo, hi)``
        of the rank's flat shard (``units``' owned parts back to back; ``pieces`` their
        :func:`owned_pieces`), zeros in padding -- for a master that is filled a tile at
        a time (the nvme tier)."""
        offsets = [0]
        for u in units:
            offsets.append(offsets[-1] + u.own_hi - u.own_lo)
        starts = [offsets[pc.unit] + pc.part.start for pc in pieces]

        def fill(lo: int, hi: int, dst: torch.Tensor) -> None:
            k = max(0, bisect.bisect_right(starts, lo) - 1)
            for pc, start in zip(pieces[k:], starts[k:]):
                if start >= hi:
                    break
                a, b = max(lo, start), min(hi, start + pc.numel)
                if a < b:
                    self.fill(pc.param, pc.lo + a - start, pc.lo + b - start,
                              dst[a - lo: b - lo])
        return fill

    def bind(self, units: list[FlatUnit], flat: torch.Tensor, *, dtype: torch.dtype,
             device: torch.device,
             bound: Callable[[FlatUnit], None] = lambda u: None) -> None:
        """Give every unit its storage: views of ``flat`` for whole units (in order),
        a transient full buffer for partitioned ones (freed at once); ``bound(unit)``
        after each (stage 3 parameter offload sends the shard home there)."""
        off = 0
        for u in units:
            def fill(i: int, lo: int, hi: int, dst: torch.Tensor, u: FlatUnit = u) -> None:
                self.fill(u.params[i], lo, hi, dst)
            if u.partition_params:
                u.bind(torch.empty(u.padded, dtype=dtype, device=device), fill)
            else:
                u.bind(flat[off: off + u.padded], fill)
                off += u.padded
            bound(u)
