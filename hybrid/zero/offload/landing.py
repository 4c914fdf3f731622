"""An offloaded optimizer's gradient sinks: each reduced shard on its way down to the host.

The reducer hands every unit's reduced shard to one sink
(:class:`~hybrid.zero.grad_sync.GradSink`, picked by the engine); with the
optimizer off the device it is one of these two, and both send each unit's
final shard down to the host step's gradient store -- host memory or
``grads.swp`` -- as soon as it is final, while backward goes on
(:meth:`~hybrid.zero.offload.host_step.OptimizerOffload.grad_ready`):

* :class:`CopyDown`: the device keeps its flat gradient shard (stage 1's full
  buffer; or, on a CPU, the flat shard that is itself the host buffer).
* :class:`GradLanding`: the device keeps none (stages 2-3; see below).

With the optimizer on the host, the step reads each unit's reduced gradient
shard from a host buffer (:class:`~hybrid.zero.offload.host_step.OptimizerOffload`).
A flat gradient shard on the device as well would cost ``e_g Psi / N`` bytes
there -- at DP 1 the whole model's gradient, more than the parameters a
parameter-offloaded model keeps on the device. So the device keeps none:

    reduce-scatter pieces --add--> landing buffer --D2H--> host gradient buffer

[Note: landing buffers]
A unit borrows one of ``count`` device buffers (each the size of the largest
unit's shard) when its first reduce-scatter piece of a micro-batch starts,
and gives it back when its last piece has been added and the copy down is
queued. The reducer's two staging buffers bound the pieces in flight, so two
landing buffers are enough: when none is free the reducer retires its oldest
reduction, which ends a unit. Device memory for gradients is then constant:
``count`` unit shards, whatever the model size.

* Micro-batches accumulate on the host. A unit's first landing of a step
  starts from zeros; a later one starts from the partial sum an earlier
  micro-batch left in its host buffer (copied back up), so each element is
  summed in the same order as in a device shard: bit-identical gradients.
  Per step that is ``k`` copies down and ``k - 1`` up of each unit's shard
  (``k`` micro-batches); one of each way with ``k = 1``.
* The clip needs the global norm, which needs every gradient; they are not on
  the device any more at step time. So each unit's squared-norm terms are
  taken on the device as its final gradient lands, before it goes down, and
  the step adds them in the order a device shard's norm would
  (:meth:`~hybrid.zero.optimizer.ShardedAdamW.sum_terms`): the same bits.
* On a GPU a buffer given back is free only once its copy down has run: the
  next borrower's stream waits for that copy's event -- the host never does.

[Note: a tied unit waits for the step]
A tied embedding's unit (hybrid/zero/engine.py, [Note: tied copies across pipeline
stages]) has a copy on the first and on the last pipeline stage, and the step sums
the two. Its final shard cannot go down when its last reduction ends: the other
stage may still be running its backward, and an all-reduce there, during backward,
would wait on the very stage that waits for this one's activation gradients. So
``final`` holds it back -- :class:`CopyDown` leaves it in the device shard,
:class:`GradLanding` parks it like a partial sum -- and the engine's step calls
``sum_tied`` first: the shard (copied back up into a landing buffer, for
:class:`GradLanding`) is all-reduced over the embedding group, its norm terms are
taken from the sum, and only then does it go down as final. One unit, once a step:
its copy up and its all-reduce are all it costs.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from hybrid.parallel.comm import CommGroup
from hybrid.zero.flat_unit import FlatUnit
from hybrid.zero.grad_sync import DeviceShard
from hybrid.zero.offload.contracts import ShardOptimizer
from hybrid.zero.offload.host_step import OptimizerOffload


class CopyDown(DeviceShard):
    """The sink of an offloaded optimizer whose gradient shard stays on the device: a
    :class:`~hybrid.zero.grad_sync.DeviceShard` whose every unit's final shard is also
    copied down to the host step's store as it completes.

    Args:
        units: the engine's units, in shard order.
        offload: the host step, which keeps the store (``grad_ready``).
        flat_grads: the engine's flat gradient buffer the shards are views of.
        tied: units summed over the embedding group at the step: they go down after
            (:meth:`sum_tied`; [Note: a tied unit waits for the step]).
    """

    overlaps = True

    def __init__(self, units: list[FlatUnit], offload: OptimizerOffload,
                 flat_grads: torch.Tensor, tied: Collection[FlatUnit] = ()):
        super().__init__(units, flat_grads)
        self.offload = offload
        self.tied = {id(u) for u in tied}

    def final(self, unit: FlatUnit) -> None:
        if id(unit) not in self.tied:
            self.offload.grad_ready(unit)

    def sum_tied(self, units: list[FlatUnit], group: CommGroup) -> None:
        super().sum_tied(units, group)
        for u in units:
            self.offload.grad_ready(u)


class GradLanding:
    """The sink of an offloaded optimizer at stages 2-3 where the device keeps no
    gradient shard: ``count`` device buffers the units' shards land in (see the Note).

    Args:
        units: the engine's units, in shard order.
        offload: the host step, which keeps the store (``park``, ``unpark``,
            ``grad_ready``, ``host_grad``).
        opt: the shard optimizer (``part_terms``, ``sum_terms`` of the norm).
        dtype, device: the gradient dtype, and where the landing buffers live.
        tied: units summed over the embedding group at the step: their final shard is
            parked, and lands again for :meth:`sum_tied` ([Note: a tied unit waits ...]).
    """

    overlaps = True

    def __init__(self, units: list[FlatUnit], offload: OptimizerOffload, opt: ShardOptimizer,
                 *, dtype: torch.dtype, device: torch.device, count: int = 2,
                 tied: Collection[FlatUnit] = ()):
        self.units, self.offload, self.opt, self.device = units, offload, opt, device
        self.tied = {id(u) for u in tied}
        self.index = {id(u): i for i, u in enumerate(units)}
        size = max(u.own_hi - u.own_lo for u in units)
        # (buffer, CUDA event after which it is free, or None)
        self.free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = [
            (torch.empty(size, dtype=dtype, device=device), None) for _ in range(count)]
        self.bytes = count * size * self.free[0][0].element_size()
        self._held: list = [None] * len(units)  # the buffer unit i has landed in
        self._parked = [False] * len(units)  # host buffer i holds this step's partial sum
        self._terms: list = [None] * len(units)  # unit i's final squared-norm terms

    def open(self, unit: FlatUnit) -> bool:
        """Make ``unit.grad_shard`` a landing buffer holding what the unit has summed so
        far this step (zeros, or its parked partial sum). False: none is free."""
        if not self.free:
            return False
        buf, freed = self.free.pop()
        i = self.index[id(unit)]
        if freed is not None:  # its last copy down has to run before anything writes it
            torch.cuda.current_stream(self.device).wait_event(freed)
        dst = buf[: unit.own_hi - unit.own_lo]
        if self._parked[i]:
            self.offload.unpark(unit, dst)
        else:
            dst.zero_()
        self._held[i] = buf
        unit.land_grads(dst)
        return True

    def partial(self, unit: FlatUnit) -> None:
        """An earlier micro-batch's reduction of ``unit`` is done: its partial sum goes
        down (parked), the buffer back to the pool."""
        self._close(unit, self.offload.park(unit))

    def final(self, unit: FlatUnit) -> None:
        """The step's last reduction of ``unit`` is done: its norm terms are taken, its
        gradient goes down for the update, the buffer back to the pool. A tied unit's
        is parked instead, until :meth:`sum_tied`."""
        if id(unit) in self.tied:
            self.partial(unit)
            return
        self._ready(unit)

    def _ready(self, unit: FlatUnit) -> None:
        i = self.index[id(unit)]
        shard = unit.grad_shard
        assert shard is not None  # (GradState.LANDED since open)
        self._terms[i] = self.opt.part_terms(i, shard)
        self._close(unit, self.offload.grad_ready(unit))

    def sum_tied(self, units: list[FlatUnit], group: CommGroup) -> None:
        """Each of ``units`` lands again (its parked sum), is summed over ``group``, and
        goes down as final, its norm terms taken from the sum."""
        for u in units:
            opened = self.open(u)
            assert opened  # (backward has ended: every landing buffer is free)
            shard = u.grad_shard
            assert shard is not None  # (GradState.LANDED since open)
            group.all_reduce(shard)
            self._ready(u)

    def _close(self, unit: FlatUnit, copied: torch.cuda.Event | None) -> None:
        i = self.index[id(unit)]
        self.free.append((self._held[i], copied))
        self._held[i] = None
        unit.release_grads()
        self._parked[i] = True

    def squared_norms(self) -> torch.Tensor:
        """The step's ``[split, replicated]`` squared norms from every unit's terms."""
        missing = [u.name for u, t in zip(self.units, self._terms) if t is None]
        if missing:
            raise RuntimeError(f"ZeRO: no final gradient of units {missing[:3]} this step "
                               f"(the last backward before step() must pass sync=True)")
        return self.opt.sum_terms(self._terms, self.device)

    def reset(self) -> None:
        """Gradients zeroed: the next landing of every unit starts from zeros."""
        self._parked = [False] * len(self.units)
        self._terms = [None] * len(self.units)

    def values(self, i: int) -> torch.Tensor:
        """Unit ``i``'s gradient as it went down (host memory; waits for the copies)."""
        return self.offload.host_grad(i)

    def device_bytes(self) -> int:
        return self.bytes
