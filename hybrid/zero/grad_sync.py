"""Gradient reduction over the DP group, launched from autograd hooks as units fill.

A post-accumulate-grad hook on every parameter counts arrivals per unit; when
a unit's last gradient lands, its reduction starts -- asynchronously with
``--overlap-comm`` (communication runs while backward computes the next
units), synchronously otherwise. ``finish()`` waits for what is in flight.

What "reduce" means per plan (N = size of the reducing group, DP x CP; k =
micro-batches per step):

* gradients not sharded (stages 0, 1): micro-batches accumulate in the full
  flat gradient buffer; only the last one (``begin(sync=True)``) reduces it, in
  place -- stage 0 all-reduces it in chunks of at most a bucket, stage 1
  reduce-scatters it so this rank's shard holds the sum. Traffic per step does
  not depend on k.
* gradients sharded (stages 2, 3): there is no full buffer to accumulate in.
  Each micro-batch's gradients are packed into a staging buffer (at most a
  bucket, from a pool of two), reduce-scattered, and this rank's part is added
  to its gradient shard; ``param.grad`` is dropped at once. Traffic per step is
  k times a reduce-scatter of Psi.

[Note: gradient precision]
Gradients are accumulated and reduced in ``grad_dtype``. When that is wider
than the parameters (fp32 for bf16/fp16 training), a full-buffer unit adds
each micro-batch's ``param.grad`` into its fp32 view from the hook and drops
it, and the staged path upcasts while packing. Every reduction divides by the
DP size *before* summing: in fp16 a sum of N gradients overflows N times sooner than
their mean.

Deferred units (parameters used in several places, see
:mod:`hybrid.zero.units`) skip the hooks' trigger and are reduced in
``finish()``, once backward is over.

[Note: unused parameters]
A parameter the loss does not reach (a pooler the model builds and never uses, a
branch some micro-batches skip) gets no gradient, and its hook never fires: its unit
never fills. With ``ignore_unused`` (DeepSpeed's
``zero_optimization.ignore_unused_parameters``, true by default) ``finish()`` reduces
every unit the backward left unfilled, once, at its end, in unit order, as it
reduces the deferred ones: a parameter without ``.grad`` packs as zeros
(:meth:`FlatUnit.copy_grads`), and at stages 0-1 its part of the full buffer holds
what earlier micro-batches added (zeros if none). It then steps as torch's AdamW
steps a parameter whose gradient is zero (weight decay, the moments' decay). The
cost is the loop over units ``finish()`` already runs: no per-parameter work. Which
units go unfilled must be the same on every rank of the reducing group in a given
backward (a static unused module, or a branch chosen by the micro-batch's index, not
by its data), since the ranks then launch the same collectives in the same order; a
rank that fills a unit another leaves empty reduces it from its hook, mid-backward,
and the two ranks' collectives no longer pair. Without ``ignore_unused``, a backward
in which a parameter got no gradient is a :class:`~hybrid.errors.TrainingError`
naming the parameters (``names``), as DeepSpeed's assertion is; the check then needs
the hooks even where nothing is reduced ([Note: no hooks when nothing is reduced]),
and a set of the parameters each backward reached.

A model in parts (an interleaved pipeline rank's chunks, :mod:`hybrid.zero.parts`)
names each backward's part at ``begin``: that backward expects gradients for
that part's units only, and ``sync`` says whether it is that part's last.

[Note: one gradient sink]
Where a reduced shard goes is the :class:`GradSink` the engine picks once, at
construction; the reducer only tells it about each unit, in order:
``sink.open(unit)`` before a micro-batch's first piece is added into the
unit's shard (stages 2-3), ``sink.partial(unit)`` when an earlier
micro-batch's last piece has been added, ``sink.final(unit)`` as soon as the
shard holds its final value for the step (its last reduction of the step's
last micro-batch has completed). :class:`DeviceShard` does nothing with them:
the device optimizer reads the flat shard after backward. An offloaded
optimizer's sinks (:mod:`hybrid.zero.offload.landing`) send each unit down to
the host while backward goes on, and at stages 2-3 give it a device buffer
only while its reduction runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from hybrid.errors import TrainingError
from hybrid.parallel.comm import CommGroup
from hybrid.zero.flat_unit import FlatUnit, Pending, piece_columns
from hybrid.zero.plan import ShardingPlan


class GradSink(Protocol):
    """Where reduced gradient shards go ([Note: one gradient sink]). The reducer calls
    :meth:`open`, :meth:`partial` and :meth:`final`; the engine the rest."""

    @property
    def overlaps(self) -> bool:
        """:meth:`final` starts work worth overlapping with the rest of backward (a copy
        down): the reducer then follows every unit as it fills, even one it reduces
        nothing for."""

    def open(self, unit: FlatUnit) -> bool:
        """Make ``unit.grad_shard`` a buffer holding the unit's sum so far this step,
        before a micro-batch adds into it. False: no buffer is free now (the reducer
        ends its oldest reduction and asks again)."""

    def partial(self, unit: FlatUnit) -> None:
        """An earlier micro-batch's reduction of ``unit`` has ended."""

    def final(self, unit: FlatUnit) -> None:
        """The step's last reduction of ``unit`` has ended: its shard is final."""

    def reset(self) -> None:
        """Gradients zeroed: the next micro-batch starts every unit from zeros."""

    def sum_tied(self, units: list[FlatUnit], group: CommGroup) -> None:
        """At the step, before anything reads a gradient: sum each of ``units`` (a tied
        embedding's copies, [Note: tied copies across pipeline stages] in
        hybrid/zero/engine.py) over ``group``, so the step, its norm terms
        and any copy down see the sum."""

    def squared_norms(self) -> torch.Tensor | None:
        """This rank's ``[TP-split, replicated]`` squared norms if the sink took them
        (the gradients left the device); None: the step takes them from the shards."""

    def values(self, i: int) -> torch.Tensor:
        """Unit ``i``'s reduced gradient shard as the step reads it (for reading)."""

    def device_bytes(self) -> int:
        """Device bytes of gradient the sink holds."""


class DeviceShard:
    """The sink of an optimizer on the device: each unit's shard is a view of the flat
    gradient buffer (:func:`~hybrid.zero.buffers.allocate_grads`), where the step
    reads it after backward; nothing moves as units complete."""

    overlaps = False

    def __init__(self, units: list[FlatUnit], flat_grads: torch.Tensor):
        self.units, self.flat = units, flat_grads

    def open(self, unit: FlatUnit) -> bool:
        return True  # (the shard is the unit's view of the flat buffer, always there)

    def partial(self, unit: FlatUnit) -> None:
        pass

    def final(self, unit: FlatUnit) -> None:
        pass

    def reset(self) -> None:
        self.flat.zero_()

    def sum_tied(self, units: list[FlatUnit], group: CommGroup) -> None:
        for u in units:
            assert u.grad_shard is not None  # (bound for good: GradState.FLAT)
            group.all_reduce(u.grad_shard)

    def squared_norms(self) -> torch.Tensor | None:
        return None

    def values(self, i: int) -> torch.Tensor:
        shard = self.units[i].grad_shard
        assert shard is not None  # (bound for good: GradState.FLAT)
        return shard

    def device_bytes(self) -> int:
        return self.flat.untyped_storage().nbytes()


class _TempPool:
    """A fixed number of reusable staging buffers: constant communication memory."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, device: torch.device):
        self.free = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]
        self.bytes = sum(t.numel() * t.element_size() for t in self.free)

    def take(self) -> torch.Tensor | None:
        return self.free.pop() if self.free else None

    def give(self, t: torch.Tensor) -> None:
        self.free.append(t)


class GradReducer:
    """Reduces each unit's gradients over ``dp`` as backward produces them and hands the
    shards to ``sink`` (see the module docstring).

    Args:
        units, plan: the engine's units and :class:`~hybrid.zero.plan.ShardingPlan`.
        dp: the reducing group (DP x CP).
        sink: where reduced shards go ([Note: one gradient sink]).
        bucket: the largest message, in elements (``--reduce-bucket-size``).
        overlap: reductions run asynchronously while backward computes.
        grad_dtype: the dtype gradients are accumulated and reduced in.
        replicas: the DP size the mean is over (default: the group's size).
        parts: the part of each unit (:mod:`hybrid.zero.parts`); default: one part.
        release: called with a unit once its gradients are packed (stage 3 frees its
            gathered parameters there); default :meth:`FlatUnit.release`.
        ignore_unused: a parameter without a gradient in a backward counts as a zero
            gradient; False: it is an error ([Note: unused parameters]).
        names: the model's ``named_parameters()``, to name them in that error (default:
            by unit).
    """

    def __init__(self, units: list[FlatUnit], plan: ShardingPlan, *, dp: CommGroup,
                 sink: GradSink,
                 bucket: int, overlap: bool, grad_dtype: torch.dtype,
                 replicas: int | None = None, parts: list[int] | None = None,
                 release: Callable[[FlatUnit], None] | None = None,
                 ignore_unused: bool = True,
                 names: Iterable[tuple[str, torch.Tensor]] = ()):
        self.units, self.plan, self.dp = units, plan, dp
        self.ignore_unused = ignore_unused
        self._names = {id(p): n for n, p in names}
        # (strict: the parameters this backward's hooks reached, [Note: unused parameters])
        self._seen: set[int] = set()
        self._release = release if release is not None else FlatUnit.release
        self._by_part: dict[int, list[FlatUnit]] = {}
        for u, k in zip(units, parts if parts is not None else [0] * len(units)):
            self._by_part.setdefault(k, []).append(u)
        self._expected = units  # the units the current backward reaches
        # the mean is over the replicas that saw different samples (DP); the rest of
        # the group (CP) holds parts of one gradient, summed (see hybrid.zero.engine)
        self.replicas = dp.size if replicas is None else replicas
        self.bucket, self.overlap = bucket, overlap
        self.sink = sink
        self.sync = True
        self._arrived = {id(u): 0 for u in units}
        self._inflight: deque = deque()  # (work, finalize, unit)
        self._left = {id(u): 0 for u in units}  # a unit's reductions not yet retired
        self.pool: _TempPool | None = None
        staged = [u for u in units if plan.grads or dp.size * u.shard_size > bucket]
        if plan.optimizer and staged:
            # Staging holds one piece (dp x columns): at most the bucket, and no more
            # than the largest unit needs.
            biggest = max(dp.size * piece_columns(u.shard_size, dp.size, bucket) for u in staged)
            self.pool = _TempPool(2, biggest, grad_dtype, units[0].params[0].device)
        # [Note: no hooks when nothing is reduced] With one rank in the reducing group,
        # gradients in the full buffer (stages 0, 1, as wide as the parameters) and
        # nobody waiting on a unit, the hooks would only count arrivals (about 6 us of
        # Python each per backward): finish() does what they would.
        self.hooked = not (ignore_unused and dp.size == 1 and not plan.grads
                           and not sink.overlaps
                           and all(u.grad_full is not None
                                   and u.grad_full.dtype == u.params[0].dtype for u in units))
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(u))
                       for u in units for p in u.params] if self.hooked else []

    def temp_bytes(self) -> int:
        """Bytes of staging buffers: the largest temporary communication memory."""
        return self.pool.bytes if self.pool else 0

    def in_flight(self) -> int:
        """Reductions launched and not yet waited for (none once :meth:`finish` returned;
        a backward that raised may leave some)."""
        return len(self._inflight)

    def drain(self) -> None:
        """Wait for every reduction still in flight (the engine's close)."""
        while self._inflight:
            self._retire_one()

    @torch.no_grad()
    def rearm(self) -> None:
        """Before another backward of a step whose reduction already ran (two backwards
        before one optimizer step: hybrid/engine/api.py, [Note: two backwards, one step]).
        Stage 1 only: each unit's full buffer becomes its reduced shard times the replicas
        (the next reduction divides by them again) and zeros elsewhere (this rank's stale
        local gradient), so the next reduce-scatter leaves shard + the new gradients' mean.
        Stage 0's buffer holds the mean everywhere, and stages 2-3 add into the shard:
        nothing to do there."""
        if self.plan.grads or not self.plan.optimizer:
            return
        for unit in self.units:
            g = unit.grad_full
            assert g is not None  # (stage 1: the unit's part of the full buffer)
            own = g[unit.own_lo: unit.own_hi] * self.replicas
            g.zero_()
            g[unit.own_lo: unit.own_hi] = own

    def begin(self, sync: bool, part: int | None = None) -> None:
        """Before a micro-batch's backward; ``sync`` marks the last one of the step --
        with ``part``, the last of that part, whose units alone this backward reaches
        (None: every unit; a part with no parameters: none)."""
        one = len(self._by_part) == 1 and part in self._by_part
        self._expected = self.units if part is None or one else self._by_part.get(part, [])
        self.sync = sync
        for k in self._arrived:
            self._arrived[k] = 0
        self._seen.clear()

    def _hook(self, unit: FlatUnit) -> Callable[[torch.Tensor], None]:
        # A full-buffer unit whose buffer is wider than param.grad: fold it in here.
        fold = (not self.plan.grads and unit.grad_full is not None
                and unit.grad_full.dtype != unit.params[0].dtype)
        offsets = {id(p): o for p, o in zip(unit.params, unit.offsets)}
        seen = None if self.ignore_unused else self._seen

        def on_grad(param: torch.Tensor) -> None:
            if seen is not None:
                seen.add(id(param))
            if fold:
                o, full = offsets[id(param)], unit.grad_full
                assert full is not None  # (fold: a full-buffer unit)
                assert param.grad is not None  # (a post-accumulate hook: it has accumulated)
                full[o: o + param.numel()].view_as(param).add_(param.grad)
                param.grad = None
            self._arrived[id(unit)] += 1
            if not unit.deferred and self._arrived[id(unit)] == len(unit.params):
                self._unit_ready(unit)
        return on_grad

    def _unit_ready(self, unit: FlatUnit) -> None:
        if not self.plan.grads:
            if self.sync:
                self._reduce_in_place(unit)
            return
        self._reduce_scatter_staged(unit, accumulate=True)
        for p in unit.params:
            p.grad = None  # the shard holds this rank's part now
        # Its gradient is packed: stage 3 frees the unit's gathered parameters until the
        # next forward (FSDP's reshard after backward; a no-op for a whole unit), unless a
        # pipeline step holds it (hybrid/zero/param_sync.py, [Note: held for a pipeline step])
        self._release(unit)

    # -- full gradient buffer (stages 0 and 1) ---------------------------------
    def _reduce_in_place(self, unit: FlatUnit) -> None:
        g, n, dp = unit.grad_full, unit.dp.size, unit.dp
        assert g is not None  # (stages 0-1: the unit's part of the full buffer)
        if self.replicas > 1:
            g.div_(self.replicas)  # mean, not sum: see [Note: gradient precision]
        if not self.plan.optimizer:  # contiguous chunks of at most a bucket, in place
            self._left[id(unit)] = len(range(0, g.numel(), self.bucket))
            for a in range(0, g.numel(), self.bucket):
                self._push(dp.all_reduce(g[a: a + self.bucket], async_op=True), None, unit)
        elif n * unit.shard_size <= self.bucket:
            own = g[unit.own_lo: unit.own_hi]
            self._left[id(unit)] = 1
            self._push(dp.reduce_scatter(own, g, async_op=True), None, unit)
        else:  # a unit larger than a bucket: stage it in pieces
            self._reduce_scatter_staged(unit, accumulate=False)

    # -- staged through the pool -----------------------------------------------
    def _reduce_scatter_staged(self, unit: FlatUnit, accumulate: bool = True) -> None:
        """Reduce-scatter ``unit``'s gradients piece by piece through pool buffers.

        ``accumulate``: add into the gradient shard, packing from the params'
        ``.grad`` (sharded gradients sum micro-batches there); otherwise
        overwrite it, packing from the full buffer (stage 1, whose shard is a
        view of the very gradients being reduced).
        """
        S, n, dp = unit.shard_size, unit.dp.size, unit.dp
        if accumulate:
            while not self.sink.open(unit):
                self._retire_one()  # every landing buffer is taken: end the oldest unit
        pool, full, shard = self.pool, unit.grad_full, unit.grad_shard
        assert pool is not None and shard is not None  # (a staged unit, its shard bound)
        c = piece_columns(S, n, self.bucket)
        self._left[id(unit)] = len(range(0, S, c))
        for k in range(0, S, c):
            w = min(c, S - k)
            tmp = pool.take()
            while tmp is None:  # both buffers in flight: retire the oldest
                self._retire_one()
                tmp = pool.take()
            grid = tmp[: n * w].view(n, w)
            for r in range(n):  # rank r's columns [k, k + w) of its shard
                lo = r * S + k
                if accumulate:
                    unit.copy_grads(lo, lo + w, grid[r])
                else:
                    assert full is not None  # (overwriting: packed from the full buffer)
                    grid[r].copy_(full[lo: lo + w])
            if accumulate and self.replicas > 1:
                grid.div_(self.replicas)  # (the full-buffer path divided already)
            mine = grid[dp.rank]
            work = dp.reduce_scatter(mine, tmp[: n * w], async_op=True)
            dst = shard[k: k + w]

            def finalize(dst: torch.Tensor = dst, mine: torch.Tensor = mine,
                         tmp: torch.Tensor = tmp) -> None:
                if accumulate:
                    dst.add_(mine)
                else:
                    dst.copy_(mine)
                pool.give(tmp)
            self._push(work, finalize, unit)

    # -- in-flight bookkeeping -------------------------------------------------
    def _push(self, work: Pending, finalize: Callable[[], None] | None,
              unit: FlatUnit) -> None:
        self._inflight.append((work, finalize, unit))
        if not self.overlap:
            self._retire_one()

    def _retire_one(self) -> None:
        work, finalize, unit = self._inflight.popleft()
        work.wait()
        if finalize is not None:
            finalize()
        self._left[id(unit)] -= 1
        if self._left[id(unit)] == 0:
            if self.sync:
                self.sink.final(unit)  # its shard is final for this step
            else:
                self.sink.partial(unit)

    def finish(self) -> None:
        """After each backward: reduce the deferred units and, with ``ignore_unused``, the
        units a parameter of which got no gradient ([Note: unused parameters]); wait for
        every launched reduction; then check (with hooks) that no unit got a gradient
        after its reduction began, no unit of another part any, and, without
        ``ignore_unused``, every parameter the backward reaches one."""
        due = self.plan.grads or self.sync  # (stages 0-1 reduce at the last micro-batch only)
        for u in self._expected:
            if not self.hooked:
                self._arrived[id(u)] = len(u.params)
                if self.sync:
                    self._unit_ready(u)
            elif due and (u.deferred or (self.ignore_unused
                                         and self._arrived[id(u)] < len(u.params))):
                self._unit_ready(u)
        while self._inflight:
            self._retire_one()
        if due:
            late = [u.name for u in self._expected
                    if self._arrived[id(u)] > len(u.params) and not u.deferred]
            if late:
                raise RuntimeError(f"ZeRO: a parameter of units {late[:3]} got a gradient "
                                   f"after its unit's reduction began (its hook ran more than "
                                   f"once this backward); every rank must reduce every unit, "
                                   f"and a parameter used in several places must be "
                                   f"registered in each")
        if self._expected is not self.units and self.hooked:
            mine = {id(u) for u in self._expected}
            strays = [u.name for u in self.units if id(u) not in mine and self._arrived[id(u)]]
            if strays:
                raise RuntimeError(f"ZeRO: units {strays[:3]} got gradients in a backward of "
                                   f"another part of the model: its parts must hold what each "
                                   f"backward reaches")
        if not self.ignore_unused:
            self._check_all_reached()

    def _check_all_reached(self) -> None:
        """Without ``ignore_unused``: a TrainingError naming the parameters of the units this
        backward reaches that got no gradient. (A count per unit; the parameters are
        looked up one by one only to name them.)"""
        if len(self._seen) == sum(len(u.params) for u in self._expected):
            return  # (none of another part's: finish raised for those before)
        missing = {id(p): f"{u.name}[{i}]" for u in self._expected
                   for i, p in enumerate(u.params) if id(p) not in self._seen}
        # (in the model's order where the engine gave the names)
        unused = [n for k, n in self._names.items() if k in missing] + [
            n for k, n in missing.items() if k not in self._names]
        if unused:
            raise TrainingError(
                f"ZeRO: parameters {unused[:10]}{' ...' if len(unused) > 10 else ''} "
                f"({len(unused)} in all) were not used in producing the loss of this "
                f"backward (no gradient). Set zero_optimization.ignore_unused_parameters to "
                f"true in the ds_config (the default; --ignore-unused-parameters) to train them "
                f"with zero gradients, or make every trainable parameter take part in the loss")
