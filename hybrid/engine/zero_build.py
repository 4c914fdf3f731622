"""Building a model under :func:`hybrid.zero_init`: real parameters while a module's
constructor runs, only this rank's part of them once it has returned.

[Note: building under zero_init]
What a constructor writes into its parameters is kept -- ``nn.init.normal_(self.weight,
std=0.02)``, a parent's ``self.fc.weight.data.zero_()``, the ``post_init`` of a
``transformers`` model, a ``GatheredParameters(..., modifier_rank=0)`` block -- and no
rank holds the model whole:

* For the context, every ``nn.Module`` class's ``__init__`` is wrapped (DeepSpeed's
  ``zero.Init`` does the same). Parameters are created for real, where the constructor
  puts them (the default device, or a ``torch.device`` context), and its writes run on
  them as in a plain build. When the outermost ``__init__`` of a module returns, the
  parameters of the module and of its submodules that are still whole are *cut*: the
  rank keeps elements ``[r * c, (r + 1) * c)`` of each one flattened
  (``c = ceil(numel / ranks)``), and the parameter object becomes a
  :class:`CutParameter` -- the same Python object, shape, dtype, device and
  ``requires_grad``, with no storage. A rank holds whole only the modules under
  construction: about one module's parameters, not the model's.
* Every rank draws the same values, so the parts agree without communication. The
  build draws from torch's global generator exactly as a plain build does, from where
  the user's ``torch.manual_seed`` put it: seed every rank the same before building (as
  DeepSpeed scripts do). Each rank folds the generator's state into a digest at every
  cut, and :func:`hybrid.initialize` refuses ranks whose digests differ. After a
  ``GatheredParameters(..., modifier_rank=k)`` block every rank goes on from rank
  ``k``'s generator state (``k`` may have drawn alone inside it). DeepSpeed instead
  broadcasts rank 0's values of every parameter; equal draws cost no communication.
* An operation on a parameter already cut (a parent initializing its child's weight,
  ``transformers``' ``post_init`` over the whole tree) brings it back whole: filled by the
  operation itself when it overwrites every element (``normal_``, ``zero_``, ``copy_``
  ...), else gathered from the ranks' parts. Inside the context it is cut again when the
  next constructor returns, or sooner when more than the largest module's worth is back;
  outside it (after the build, before ``initialize``), right after the operation.
* ``initialize`` takes the parts as they are (:class:`BuiltValues`): each parameter is
  gathered once, one at a time, and the rank keeps the ranges its ZeRO layout needs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import logging
import os
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

if TYPE_CHECKING:
    from torch._ops import OpOverload

    from hybrid.parallel.comm import CommGroup

log = logging.getLogger("hybrid")
# (torch 2.13 renamed it; its old name warns)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Build:
    """The ranks one ``zero_init()`` context builds for: they share each parameter."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group)
        # NCCL talks in device tensors; then the device's generator draws too
        self.comm_device = (torch.device("cuda", torch.cuda.current_device())
                            if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        self.digest = hashlib.blake2b(digest_size=16)  # the generator states at every cut

    def fold_rng(self) -> None:
        """Fold the generators' state into the digest (see the module note)."""
        self.digest.update(torch.get_rng_state().numpy().tobytes())
        if self.comm_device.type == "cuda":
            self.digest.update(torch.cuda.get_rng_state().numpy().tobytes())

    def bounds(self, numel: int) -> tuple[int, int]:
        """This rank's elements [lo, hi) of a parameter of ``numel`` elements."""
        c = -(-numel // self.size)
        lo = min(numel, self.rank * c)
        return lo, min(numel, lo + c)

    # -- collectives over the build's ranks (every rank calls them in the same order) ----
    def gather(self, part: Part) -> torch.Tensor:
        """The whole parameter, flattened, on its device: every rank's part of it."""
        c = -(-part.numel // self.size)
        size = part.shard.element_size()
        send = torch.zeros(c * size, dtype=torch.uint8, device=self.comm_device)
        send[: part.shard.numel() * size].copy_(part.shard.view(torch.uint8))
        out = torch.empty(self.size * c * size, dtype=torch.uint8, device=self.comm_device)
        all_gather_single(out, send, group=self.group)
        return out.view(part.dtype)[: part.numel].to(part.device)

    @torch.no_grad()
    def broadcast_(self, t: torch.Tensor, src: int) -> None:
        """``t`` <- DP rank ``src``'s ``t`` (bit for bit, any dtype)."""
        buf = t.detach().contiguous().view(-1).view(torch.uint8).to(self.comm_device)
        dist.broadcast(buf, group=self.group, group_src=src)
        t.copy_(buf.to(t.device).view(t.dtype).view(t.shape))

    def take_rng(self, src: int) -> None:
        """Every rank goes on from rank ``src``'s generator state."""
        state = torch.get_rng_state()
        self.broadcast_(state, src)
        torch.set_rng_state(state)
        if self.comm_device.type == "cuda":
            state = torch.cuda.get_rng_state()
            self.broadcast_(state, src)
            torch.cuda.set_rng_state(state)


class Part:
    """A cut parameter's values on this rank: ``shard`` (elements [lo, hi) of the
    parameter flattened), and ``whole`` (all of them, flattened) while it is back whole.
    ``held``: open ``GatheredParameters`` blocks keeping it whole."""

    def __init__(self, build: Build, shard: torch.Tensor, numel: int, lo: int, hi: int):
        self.build, self.shard, self.numel, self.lo, self.hi = build, shard, numel, lo, hi
        self.dtype, self.device = shard.dtype, shard.device
        self.whole: torch.Tensor | None = None
        self.held = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.shard.element_size()

    def bring_back(self, filled_by_op: bool) -> torch.Tensor:
        """Make the parameter whole: gathered, or (``filled_by_op``) left for the operation
        about to run to fill every element."""
        if self.whole is None:
            builder = _ACTIVE
            if builder is not None:  # room first: what else is back goes to its shard
                builder.make_room(self)
            self.whole = (torch.empty(self.numel, dtype=self.dtype, device=self.device)
                          if filled_by_op else self.build.gather(self))
            if builder is not None:
                builder.back.append(self)
        return self.whole

    @torch.no_grad()
    def put_away(self) -> None:
        """Back to this rank's shard (the whole values' part of it)."""
        if self.whole is not None and not self.held:
            self.shard.copy_(self.whole[self.lo: self.hi])
            self.whole = None

    def after_op(self) -> None:
        """Outside a build no constructor will return to cut it again: at once."""
        if _ACTIVE is None:
            self.put_away()


class CutParameter(torch.Tensor):
    """A parameter cut by ``zero_init()`` (see the module note), or a view of one: its
    :class:`Part` and this tensor's geometry over the parameter (a meta tensor). Any
    operation runs on the parameter's whole values; ``isinstance(p, nn.Parameter)``
    holds for the parameter itself."""

    _part: Part
    _meta: torch.Tensor

    @staticmethod
    def __new__(cls, part: Part, meta: torch.Tensor, requires_grad: bool = False
                ) -> CutParameter:
        t = torch.Tensor._make_wrapper_subclass(
            cls, meta.size(), strides=meta.stride(), storage_offset=meta.storage_offset(),
            dtype=meta.dtype, device=part.device, requires_grad=requires_grad)
        t._part, t._meta = part, meta
        return t

    # no Python-level overrides: every operation reaches __torch_dispatch__. torch has no
    # public name for this: its tensor-subclass guide prescribes this attribute for a
    # dispatch-only subclass (torch's stub types the slot as a method)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # no gather just to print (torch's stub names its keyword argument oddly)
    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]
        return (f"CutParameter(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, this rank's elements [{self._part.lo}, "
                f"{self._part.hi}) of {self._part.numel})")

    def __deepcopy__(self, memo: dict[int, Any]) -> CutParameter:
        """A copy with a part of its own (``copy.deepcopy`` of a module built under
        ``zero_init()``, as ``clones(layer, n)`` idioms do): no gather, still cut."""
        if id(self) in memo:
            return memo[id(self)]
        part, m = self._part, self._meta
        if m.numel() != part.numel or not m.is_contiguous() or m.storage_offset() != 0:
            raise RuntimeError("copy.deepcopy of a view of a parameter cut by zero_init()")
        values = part.shard if part.whole is None else part.whole[part.lo: part.hi]
        new = CutParameter(Part(part.build, values.clone(), part.numel, part.lo, part.hi),
                           m, requires_grad=self.requires_grad)
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()
                             if k not in ("_part", "_meta")})
        memo[id(self)] = new
        return new

    @classmethod
    def __torch_dispatch__(cls, func: OpOverload, types: Collection[type],  # type: ignore[override]
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        return _run(func, args, kwargs or {})


# The operations that write every element of their output whatever it held (with the
# output an ``out=`` argument, any operation does)
_FILLS = {"normal_", "uniform_", "fill_", "zero_", "random_", "exponential_", "geometric_",
          "log_normal_", "cauchy_", "bernoulli_", "copy_"}
# The operations that read only the shape of a tensor argument
_SHAPE_ONLY = {"new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
               "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
               "randn_like", "randint_like"}


def _written(func: OpOverload, args: Sequence[object],
             kwargs: Mapping[str, object]) -> list[tuple[str, object]]:
    """(argument name, value) of each argument ``func`` writes."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append((a.name, args[i] if i < len(args) else kwargs.get(a.name)))
    return out


def _is_view(func: OpOverload) -> bool:
    schema = func._schema
    return (any(r.alias_info is not None for r in schema.returns)
            and not any(a.alias_info is not None and a.alias_info.is_write
                        for a in schema.arguments))


def _fills_all(func: OpOverload, written: list[tuple[str, object]], cuts: list[CutParameter],
               part: Part) -> bool:
    """The operation overwrites every element of ``part``'s parameter and reads none."""
    mine = [t for t in cuts if t._part is part]
    target = [v for _, v in written if isinstance(v, CutParameter) and v._part is part]
    if len(target) != 1 or len(mine) != 1:  # (also: read through another alias of it)
        return False
    if not (func._schema.name.split("::")[-1] in _FILLS
            or any(n == "out" and v is target[0] for n, v in written)):
        return False
    m = target[0]._meta
    return m.numel() == part.numel and m.is_contiguous() and m.storage_offset() == 0


def _run(func: OpOverload, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """``func`` with :class:`CutParameter` arguments (see the module note)."""
    cuts = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, CutParameter)]
    if _is_view(func):  # a view of a cut parameter is a CutParameter of the same part
        part = cuts[0]._part
        out = func(*tree_map(_meta_of, args), **tree_map(_meta_of, kwargs))
        return tree_map(lambda m: CutParameter(part, m) if isinstance(m, torch.Tensor) else m,
                        out)
    if func._schema.name.split("::")[-1] in _SHAPE_ONLY:
        return func(*tree_map(_blank_of, args), **tree_map(_blank_of, kwargs))
    parts = list({id(t._part): t._part for t in cuts}.values())
    written = _written(func, args, kwargs)
    for part in parts:  # (held: bringing back the next one makes no room by cutting it)
        part.bring_back(filled_by_op=_fills_all(func, written, cuts, part))
        part.held += 1
    # id(real view) -> (the cut tensor it stands for, the view: alive while ids are compared)
    real: dict[int, tuple[CutParameter, torch.Tensor]] = {}

    def to_real(t: object) -> object:
        if not isinstance(t, CutParameter):
            return t
        whole = t._part.whole
        assert whole is not None
        r = whole.as_strided(t._meta.size(), t._meta.stride(), t._meta.storage_offset())
        real[id(r)] = (t, r)
        return r
    try:
        out = func(*tree_map(to_real, args), **tree_map(to_real, kwargs))
    finally:
        for part in parts:
            part.held -= 1
    for part in parts:
        part.after_op()
    # an in-place operation returns its argument: the caller's tensor, not our view
    return tree_map(lambda o: real[id(o)][0] if isinstance(o, torch.Tensor) and id(o) in real
                    else o, out)


def _meta_of(t: object) -> object:
    return t._meta if isinstance(t, CutParameter) else t


def _blank_of(t: object) -> object:
    if not isinstance(t, CutParameter):
        return t
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)


# -- the build: constructors wrapped for the context ----------------------------------------
_ACTIVE: Builder | None = None


def _module_classes() -> list[type]:
    """``nn.Module`` and every subclass of it defined so far."""
    out: list[type] = []
    seen: set[type] = set()
    todo: list[type] = [nn.Module]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _wrapped_init(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(module: nn.Module, *args: object, **kwargs: object) -> None:
        builder = _ACTIVE
        if builder is None or id(module) in builder.building:  # a super().__init__
            init(module, *args, **kwargs)
            return
        builder.building.add(id(module))
        try:
            init(module, *args, **kwargs)
        finally:
            builder.building.discard(id(module))
        builder.constructed(module)  # (not reached when the constructor raised)
    return __init__


class Builder:
    """The state of one ``zero_init()`` context that cuts (see the module note)."""

    def __init__(self, build: Build):
        self.build = build
        self.building: set[int] = set()  # modules inside their outermost __init__
        self.built: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # made in the context
        self.back: list[Part] = []  # cut parameters back whole, oldest first
        self.budget = 0  # bytes: the most one module's constructor left whole
        self._wrapped: list[tuple[type, Callable]] = []
        self._subclass_hook = nn.Module.__dict__.get("__init_subclass__")

    def wrap(self, cls: type) -> None:
        init = cls.__dict__.get("__init__")
        if init is not None:
            self._wrapped.append((cls, init))
            type.__setattr__(cls, "__init__", _wrapped_init(init))

    def __enter__(self) -> Builder:
        global _ACTIVE  # noqa: PLW0603 - the process's one active build (constructors are global)
        for cls in _module_classes():
            self.wrap(cls)
        builder, before = self, self._subclass_hook

        def init_subclass(cls: type, **kwargs: object) -> None:  # classes made in the context
            if before is not None:
                before.__get__(None, cls)(**kwargs)
            else:
                # (a classmethod's super(); mypy takes cls for an instance)
                super(nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
            builder.wrap(cls)
        # torch's class, patched for the context (as DeepSpeed's zero.Init does)
        nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE  # noqa: PLW0603 - the process's one active build (constructors are global)
        try:
            if exc[0] is None:
                for module in list(self.built):  # parameters added after every constructor
                    self.constructed(module)
                self.build.fold_rng()
        finally:
            for part in self.back:
                part.put_away()
            self.back.clear()
            _ACTIVE = None
            for cls, init in reversed(self._wrapped):
                type.__setattr__(cls, "__init__", init)
            if self._subclass_hook is not None:
                type.__setattr__(nn.Module, "__init_subclass__", self._subclass_hook)
            else:
                type.__delattr__(nn.Module, "__init_subclass__")

    def constructed(self, module: nn.Module) -> None:
        """``module``'s outermost constructor returned: cut what is whole in it, and put
        back what an operation brought back."""
        self.built.add(module)
        new: dict[int, nn.Parameter] = {}
        for sub in module.modules():
            if sub not in self.built or id(sub) in self.building:
                continue  # built before the context, or still being built
            for p in sub._parameters.values():
                if _cuttable(p):
                    new[id(p)] = p
        if new:
            self.build.fold_rng()
            self.budget = max(self.budget, sum(p.numel() * p.element_size()
                                               for p in new.values()))
            for p in new.values():
                self.cut(p)
        for part in self.back:
            part.put_away()
        self.back = [p for p in self.back if p.whole is not None]

    def make_room(self, coming: Part) -> None:
        """Put back what is back whole when ``coming`` would pass the budget."""
        live = sum(p.nbytes for p in self.back)
        if self.back and live + coming.nbytes > max(self.budget, coming.nbytes):
            for part in self.back:
                part.put_away()
            self.back = [p for p in self.back if p.whole is not None]

    @torch.no_grad()
    def cut(self, p: nn.Parameter) -> None:
        """``p`` becomes a :class:`CutParameter` holding this rank's part of its values."""
        lo, hi = self.build.bounds(p.numel())
        shard = p.detach().reshape(-1)[lo:hi].clone()
        part = Part(self.build, shard, p.numel(), lo, hi)
        cut = CutParameter(part, torch.empty(p.shape, dtype=p.dtype, device="meta"),
                           requires_grad=p.requires_grad)
        cut.__dict__.update(p.__dict__)
        cut._is_param = True  # isinstance(cut, nn.Parameter), as for torch's own subclasses
        try:
            torch.utils.swap_tensors(p, cut)  # the same object: every module slot keeps it
        except RuntimeError as e:
            raise RuntimeError(f"zero_init(): cannot cut a parameter of shape {tuple(p.shape)} "
                               f"when its constructor returns: {e} (a view of it kept in the "
                               f"module holds it; keep the parameter, not a view)") from e


def _cuttable(p: object) -> TypeGuard[nn.Parameter]:
    """A plain, real, dense parameter (a lazy module's uninitialized one, a tensor
    subclass's, a sparse or meta one stays as it is)."""
    return (type(p) is nn.Parameter and p.layout == torch.strided and not p.is_meta
            and not nn.parameter.is_lazy(p))


def resolve_group(group: dist.ProcessGroup | CommGroup | None) -> dist.ProcessGroup | None:
    """The process group a ``zero_init(group)`` cuts over, or None to build whole: the
    given one (a torch ProcessGroup, or hybrid's CommGroup), else torch.distributed's
    world when it is initialized."""
    # (a CommGroup's torch group; a torch one has no pg)
    group = cast("dist.ProcessGroup | None", getattr(group, "pg", group))
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log.warning("zero_init(): torch.distributed is not initialized, so every rank builds "
                    "the whole model; join the job first (hybrid.deepspeed.init_distributed() "
                    "or torch.distributed.init_process_group) to build only each rank's part")
    return None


@contextlib.contextmanager
def building(group: dist.ProcessGroup | CommGroup | None = None) -> Iterator[None]:
    """Cut each module's parameters as its constructor returns (the module note), over
    ``group`` (:func:`resolve_group`). One process builds as usual; a context inside
    another is part of the outer one's build."""
    pg = resolve_group(group) if _ACTIVE is None else None
    if pg is None or dist.get_world_size(pg) == 1:
        yield
        return
    with Builder(Build(pg)):
        yield


def active() -> bool:
    """A build is cutting now."""
    return _ACTIVE is not None


@contextlib.contextmanager
def gathered(params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
    """``GatheredParameters`` during or after a build, before ``initialize``: cut
    parameters are whole inside (gathered); with ``modifier_rank`` its values become
    every rank's afterwards, and inside a build every rank goes on from its generator
    state. Without it each rank keeps what it wrote."""
    cut = [p for p in params if isinstance(p, CutParameter)]
    builder = _ACTIVE
    build = cut[0]._part.build if cut else builder.build if builder is not None else None
    if build is None:  # nothing cut, nothing being built: a plain model
        yield
        return
    parts = list({id(p._part): p._part for p in cut}.values())
    for part in parts:
        part.bring_back(filled_by_op=False)
        part.held += 1
    try:
        yield
    finally:
        for part in parts:
            part.held -= 1
    if modifier_rank is not None:  # (not when the block raised: a peer may not be here)
        for p in params:
            whole = p._part.whole if isinstance(p, CutParameter) else p
            assert whole is not None
            build.broadcast_(whole, modifier_rank)
        if builder is not None:
            build.take_rng(modifier_rank)
    for part in parts:
        part.after_op()


def held_whole_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of ``params`` this rank holds whole now: real parameters, and cut ones
    brought back (for tests of the build's memory)."""
    total = 0
    for p in {id(p): p for p in params}.values():
        if isinstance(p, CutParameter):
            total += p._part.nbytes if p._part.whole is not None else 0
        elif not p.is_meta:
            total += p.numel() * p.element_size()
    return total


def is_cut(p: torch.Tensor) -> bool:
    """``p`` was cut by a build and holds this rank's part only."""
    return isinstance(p, CutParameter)
