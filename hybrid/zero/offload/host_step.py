"""ZeRO-Offload: the optimizer step runs on the host, overlapped with the device's work.

The fp32 master shard and both Adam moments live in host memory (allocated by
the engine, pinned when a GPU exists). Per unit of the shard (a gradient
bucket at stages 1-2, a module or bucket at stage 3) this module moves

    device gradient shard  --(D2H, gradient dtype)-->  host gradient buffer
    host parameter copy    --(H2D, training dtype)-->  device parameter shard

and the fused CPU kernel (``hybrid.kernels.adam_step``) reads the first and
writes the second in the same pass as the Adam update. The gradient dtype is
fp32 when gradients are accumulated in fp32 (``--accumulate-allreduce-grads-in-fp32``,
the default with bf16): 6 bytes per parameter per step over PCIe. With
``--no-accumulate-allreduce-grads-in-fp32`` both directions move the training
dtype, 4 bytes per parameter per step in bf16/fp16, the ZeRO-Offload paper's
figure.

[Note: what overlaps what]
* A unit's gradient goes down as soon as its reduction of the step's last
  micro-batch has finished (``GradReducer`` calls :meth:`grad_ready`), on a
  copy stream, while backward goes on with the units before it.
* The host update runs on one worker thread, unit by unit in a fixed order;
  unit ``i``'s new parameters go up (and, at stages 1-2, its all-gather
  starts) while the worker updates unit ``i + 1``.
* The update cannot start before backward ends: clipping scales every
  gradient by a coefficient of the global norm, and a non-finite norm skips
  the step, so the first element needs the last gradient. The clip
  coefficient and the skip flag come down as two numbers the worker waits
  for; the main thread never reads them.
* With ``--offload-delayed-update`` (the paper's one-step delayed parameter
  update), step ``t``'s update runs on the worker during step ``t + 1``'s
  forward and backward, and its parameters go up at the end of step ``t + 1``:
  step ``t + 1``'s gradient is taken at parameters one update old. The first
  ``--offload-delayed-update-warmup`` steps update normally (early updates are
  large, staleness hurts most there). A unit's host gradient buffer is
  rewritten only after the update in flight has read it.

* At stages 2-3 the device keeps no gradient shard: each unit's reduction
  lands in one of a few device buffers and goes down to the host buffer as
  soon as it is done, in every micro-batch (:mod:`hybrid.zero.offload.landing`);
  only the last micro-batch's is "ready" for the update.

The worker does the same arithmetic in the same order whatever the timing,
so runs are bitwise reproducible. On a CPU-only machine the same path runs
with host tensors (the copies are memcpys); there, at stages 2-3 without the
delayed update, the engine's flat gradient shard is already a contiguous host
buffer in master order and is read in place.

[Note: what starts before the step]
Under a pipeline a stage's last backward ends while the stages before it still drain
theirs, and its step waits for them twice: at the loss all-reduce over the stages and
at the global norm. What it could do meanwhile without changing a bit is narrow:

* its gradients already go down (and, on NVMe, to ``grads.swp``) as each unit's last
  reduction ends, during backward ([Note: what overlaps what]);
* the update cannot start for sure: with clipping every gradient is scaled by a
  coefficient of the global norm, and without (``--clip-grad 0``, no dynamic fp16
  scaling) it still hangs on the skip decision, which an inf or NaN on any stage makes
  ([Note: one skip decision ...] in hybrid/zero/engine.py). AdamW writes master and
  moments in place with rounding no step can undo, so the host tier (states updated
  where they live) would need a copy of all three (12 bytes per element) to fall back
  on: it does not speculate;
* on the nvme tier it can, speculatively, where the fallback is free: the read-ahead
  tiles' states are copies (staging buffers) and the file keeps the old ones until the
  tile loop writes them back. Given the step's ``lr`` and loss scale (:meth:`prefetch`,
  from the pipeline step), the worker -- the main thread goes on to the loss
  all-reduce and the norm at once -- waits until the final gradients of those tiles'
  units are on disk (``SwappedGrads.stored[i]``: set by the gradient writer only after
  every write of the unit's last ``store`` has ended; the run of tiles stops at one with
  a unit not yet final, e.g. a tied one, summed at the step), reads them and updates
  the tiles in their buffers with the scalars the step would use if the clip
  coefficient were exactly 1 and the step not skipped
  (:meth:`SwappedAdamW.speculative_scalars`: ``ones / scale`` in fp64, the division the
  step makes after its ``clamp(..., max=1.0)``; the next step count; skip 0). Their new
  parameters go to buffers of their own: nothing is published or written ([Note:
  holding read-ahead tiles] in nvme/tiles.py). At the step the worker compares: the
  step's ``begin_step`` scalars bitwise equal to those and the same ``lr`` -> the tile
  loop takes those tiles as updated (their parameters copied to where the kernel would
  have written them; written back and published in the loop's order as any tile);
  anything else (the clip binds, a non-finite norm, a skip, fp16's included, another
  lr) -> they are dropped and the loop reads those it had updated again from the
  file (the gradients read stay). The kernel is
  elementwise and piece-exact, so a kept tile holds the bits the loop would have made
  and a dropped one is recomputed from untouched states: bit-identical either way
  (tests/zero/test_nvme_speculation.py, and tests/scripts/test_pretrain_gpt.py at PP 2).
  Kept where the clip does not bind (a norm below ``--clip-grad``, or ``--clip-grad 0``);
  where it binds, the tiles it updated are read and computed once more. Measured
  (CPU-2, docs/pipeline-parallelism.md "What starts before the step"): kept, the last
  stage's host step 0.57 -> 0.47 s (3 tiles of 8M, PP 2, DP 1); discarded, 0.1 s (DP 1)
  to 0.3 s (DP 2) longer, the wasted work sharing two cores and one disk with the other
  stage's step -- so after one the step did not use, the next steps sit out, ever
  longer while the clip binds ([Note: sitting out while the clip binds] in
  speculative.py). Host memory: ``C - 1`` tiles of parameters in the training dtype.
  Not with ``--offload-delayed-update`` (the flag refuses the pair, the engine does not
  speculate): its update runs in the next step.
  ``--no-offload-speculative-step`` turns it off; :meth:`speculation` counts the tiles.
  (The mechanics: hybrid/zero/offload/nvme/speculative.py, which also stops a
  speculation the step's scalars have outrun: [Note: a speculation the step has outrun]);
* the data movement can: on the nvme tier :meth:`OptimizerOffload.prefetch` starts the
  reads of the first ``--offload-buffer-count - 1`` tiles' states into the staging
  buffers the update reads them into ([Note: reading ahead of the step] in
  hybrid/zero/offload/nvme/tiles.py); the update then finds them there. The pipeline
  step calls it (:meth:`~hybrid.zero.ZeroEngine.prefetch_step`) as soon as the
  executor's list has ended. The host tier has nothing to move.

[Note: the delayed update runs last to first]
The update in flight during a step's backward must have read a unit's host
gradient before that unit's new one comes down, and backward sends the last
unit first. Run forward, backward would wait at its first unit for the whole
update; run last to first, it waits (if at all) only for the units the update
has not reached yet. Every element's update is independent of the others', so
the order changes no bit. Steps that are not delayed keep the forward order:
their uploads (and, at stages 1-2, all-gathers) go out in it while the worker
goes on.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hybrid.config.sections import OffloadConfig
from hybrid.kernels.aio import AsyncIO
from hybrid.zero.flat_unit import FlatUnit, shard_bounds
from hybrid.zero.offload.contracts import (
    GradStore,
    ParamHome,
    ParamPublisher,
    ShardOptimizer,
    Speculation,
    SpeculationOf,
    Waitable,
)
from hybrid.zero.offload.grads import HostGrads, stream_copy
from hybrid.zero.offload.writer import HomeWriter
from hybrid.zero.plan import ShardingPlan


class OptimizerOffload:
    """Host staging buffers for one rank's shard and the worker that updates it.

    Args:
        units: the engine's units; unit ``i`` owns ``[own_lo, own_hi)`` of its flat
            buffer, and the host buffers hold those pieces back to back.
        dtype: the model's training dtype (the parameters that go back up).
        flat_grads: the engine's flat gradient buffer, or None when gradients only
            land on the device (hybrid/zero/offload/landing.py).
        grad_dtype, device: what goes down, and from where.
        plan: the engine's :class:`~hybrid.zero.plan.ShardingPlan`.
        opt: the shard optimizer, in the same order: a
            :class:`~hybrid.zero.optimizer.ShardedAdamW` over the host fp32 master
            (the cpu tier) or a :class:`~hybrid.zero.offload.nvme.adamw.SwappedAdamW`
            over tiles on disk (the nvme tier). Its ``chunks()`` are the pieces the
            worker updates one at a time (units, or tiles).
        cfg: ``delayed_update`` (and its ``delayed_update_warmup`` normal steps
            before the one-step delayed update starts).
        swapped_grads: the nvme tier's :class:`~hybrid.zero.offload.nvme.grads.SwappedGrads`,
            where the gradients go instead of a host buffer (None: host memory).
        speculation_of: makes the speculative update from the worker and each tile's
            units ([Note: what starts before the step]); None: the step makes none
            (``OffloadTiers.speculation_of`` decides: the nvme tier's, its gradients
            swapped with the tiles).
        pin: page-locked host buffers (``OffloadTiers.pin``, decided once).
        homes: each unit's parameter home (``OffloadTiers.homes``; None: no home, or
            no parameter offload at all).
        publisher: told each unit whose new parameter shard is on the device (or home),
            as the update goes (the engine's all-gathers of whole units).
    """

    def __init__(self, units: list[FlatUnit], opt: ShardOptimizer, cfg: OffloadConfig, *,
                 plan: ShardingPlan, dtype: torch.dtype, grad_dtype: torch.dtype,
                 device: torch.device,
                 flat_grads: torch.Tensor | None, homes: list[ParamHome | None],
                 publisher: ParamPublisher, swapped_grads: GradStore | None = None,
                 speculation_of: SpeculationOf | None = None, pin: bool = False):
        self.units = units
        self.dtype = dtype
        self.homes = homes
        self.publisher = publisher
        self.index = {id(u): i for i, u in enumerate(units)}
        self.bounds = shard_bounds(units)
        n = self.bounds[-1]
        self.cuda = device.type == "cuda"
        self.pin = pin  # pinned host memory makes the copies asynchronous DMA
        self.delayed = cfg.delayed_update
        self.warmup = cfg.delayed_update_warmup if cfg.delayed_update else 0
        in_place = (flat_grads is not None and flat_grads.device.type == "cpu" and plan.grads
                    and not self.delayed)
        self.grads: GradStore
        # what the step reads its gradient from (None: the swapped tiles bring it)
        self._flat_grad: torch.Tensor | None = None
        if swapped_grads is None:
            host = HostGrads(flat_grads if in_place and flat_grads is not None else
                             torch.empty(n, dtype=grad_dtype, pin_memory=self.pin),
                             self.bounds, own=not in_place)
            self.grads, self._flat_grad = host, host.flat
        else:
            self.grads = swapped_grads
        self.opt = opt
        self.master = opt.flat_master  # None on the nvme tier
        self._chunks = opt.chunks()
        self._chunk_units = chunk_units(self._chunks, self.bounds)
        # ([Note: the delayed update runs last to first])
        self._forward_ends = [ends for _, ends in self._chunk_units]
        self._reverse_ends = reverse_ends(self._chunks, self.bounds)
        self._ends = self._forward_ends  # the update's in flight, per chunk
        # fp32 models upload the host master itself: no narrow copy to make.
        master_uploads = dtype == torch.float32 and self.master is not None
        # Stage 3 parameter offload: the new shards go straight home (writer.py),
        # unless the delayed update needs a copy to hold them for a step.
        self.writer = None
        if any(h is not None for h in self.homes) and not self.delayed:
            self.writer = HomeWriter(self.homes, self.bounds, chunk_units=self._chunk_units,
                                     chunks=self._chunks, dtype=dtype,
                                     master_uploads=master_uploads, pin=self.pin)
            self.out = None
        else:
            self.out = None if master_uploads else torch.empty(n, dtype=dtype,
                                                               pin_memory=self.pin)
        self._fill_upload_copies()  # what a skipped first step would upload
        self.found = torch.zeros(1, dtype=torch.float32)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._scalars = torch.zeros(2, dtype=torch.float64, pin_memory=self.pin)
        k = len(units)
        self._sent = [False] * k  # this step's gradient of unit i went down
        self._written = [False] * k  # host grad i was written this step (waited for the update)
        self._down: list = [None] * k  # CUDA event: it has arrived
        self._up: list = [None] * k  # CUDA event: unit i's last upload has been read out
        self._consumed = [threading.Event() for _ in range(k)]  # host grad i may be rewritten
        self._ready = [threading.Event() for _ in range(k)]  # unit i's new params are in src
        for e in self._consumed:
            e.set()
        self._skipped = False
        self._failed = False  # the worker raised: uploads stop, the step re-raises it
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="hybrid-offload")
        self._pending: Future[None] | None = None  # the update in flight
        self._upload_due = False  # its parameters still have to go up
        self.steps = 0
        # seconds, summed over steps: the main thread in step(), the worker in the kernels
        self.step_s = self.adam_s = 0.0
        # ... and the main thread blocked in backward until the update in flight (the
        # delayed update's) had read a host gradient buffer it rewrites
        self.update_wait_s = 0.0
        self._chunk_t0 = 0.0
        # [Note: what starts before the step]: the nvme tier's speculative update (its
        # gradients swapped with the tiles; never with the delayed update)
        self.speculative: Speculation | None = None
        self.read_ahead = 0  # chunks whose reads prefetch() started, summed over steps
        if cfg.speculative_step and not self.delayed and speculation_of is not None:
            self.speculative = speculation_of(self._worker, [t for t, _ in self._chunk_units])

    def _piece(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.bounds[i]: self.bounds[i + 1]]

    # -- during backward -----------------------------------------------------------
    @torch.no_grad()
    def grad_ready(self, unit: FlatUnit) -> torch.cuda.Event | None:
        """``unit``'s gradient shard is final for this step: send it down now. Returns
        the CUDA event of its copy (None: done, or nothing to copy)."""
        i = self.index[id(unit)]
        self._sent[i] = True
        return self.park(unit) if self.grads.own else None

    @torch.no_grad()
    def park(self, unit: FlatUnit) -> torch.cuda.Event | None:
        """Copy ``unit``'s gradient shard (a partial sum of the step's micro-batches, or
        the final one) into its host buffer; returns the copy's CUDA event, or None."""
        i = self.index[id(unit)]
        if not self._written[i]:
            if not self._consumed[i].is_set():  # the update in flight has not read it yet
                t0 = time.perf_counter()
                self._consumed[i].wait()
                self.update_wait_s += time.perf_counter() - t0
            self._consumed[i].clear()
            self._written[i] = True
        shard = unit.grad_shard
        assert shard is not None, unit.name  # (a parked or final shard is on the device)
        self._down[i] = self.grads.store(i, shard, self.copy_stream)
        return self._down[i]

    @torch.no_grad()
    def unpark(self, unit: FlatUnit, dst: torch.Tensor) -> None:
        """``dst`` (on the device) <- ``unit``'s host gradient buffer, the partial sum an
        earlier :meth:`park` of this step left there; ordered before the current
        stream's next work, without a host wait."""
        self.grads.load(self.index[id(unit)], dst, self.copy_stream)

    def host_grad(self, i: int) -> torch.Tensor:
        """Unit ``i``'s gradient as it went down (host memory), once the copies have
        landed: for reading, where the step is stopped anyway (a skipped step)."""
        if self.copy_stream is not None:  # (CUDA)
            self.copy_stream.synchronize()
        return self.grads.values(i)

    def prefetch(self, lr: float | None = None, grad_scale: float | None = None) -> None:
        """This step's gradients are all down or on their way (the rank's last backward
        has ended): start reading what the update reads first, before the norm and the
        skip decision it waits for are known (the nvme tier's first tiles; [Note: what
        starts before the step]). Nothing while an update is in flight or when the update
        is delayed (its tiles are read by the worker, during the next step).

        Given ``lr`` and ``grad_scale`` (the loss scale times the divisor the step will
        use), the worker also updates those tiles whose gradients are final, as the step
        would with clip coefficient 1 and no skip; the step keeps it only if so (the Note)."""
        if self.delayed or self._pending is not None or self._failed:
            return
        self.read_ahead += self.opt.prefetch()
        if self.speculative is not None and lr is not None and grad_scale is not None:
            self.speculative.start(lr, grad_scale, self._sent)

    def speculation(self) -> dict:
        """:meth:`SpeculativeUpdate.counts` of the tiles ({} where there is none)."""
        return {} if self.speculative is None else self.speculative.counts()

    # -- the step --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, grad_scale: torch.Tensor,
             skip: torch.Tensor | None) -> torch.Tensor:
        """Update the host shard from this step's gradients and send parameters up.

        ``grad_scale``, ``skip``: device tensors (never read by this thread).
        The publisher is told each unit once its new parameter shard is on the
        device (the engine starts its all-gather). Without the delayed update
        the new parameters are on the device on return; with it, the previous
        step's are, and this step's update is running on the worker.
        """
        t0 = time.perf_counter()
        try:
            return self._step(lr, grad_scale, skip)
        finally:
            self.step_s += time.perf_counter() - t0

    def _step(self, lr: float, grad_scale: torch.Tensor,
              skip: torch.Tensor | None) -> torch.Tensor:
        self.steps += 1
        for u, sent in zip(self.units, self._sent):
            # (a unit no reduction reported: cannot happen with the engine's hooks)
            if not sent and u.grad_shard is not None:
                self.grad_ready(u)
        self._sent = [False] * len(self.units)
        self._written = [False] * len(self.units)
        if self._upload_due:  # the delayed update of the previous step: its params go up
            self._upload()
        self._wait_update()  # (it read the scalars buffer that is rewritten next)
        scalars_ready = self._scalars_down(grad_scale, skip)
        if self.speculative is not None:  # (a speculation it outruns stops early)
            self.speculative.post(self._scalars, scalars_ready, lr)
        for e in self._ready:
            e.clear()
        delayed = self.delayed and self.steps > self.warmup
        task = self._worker.submit(self._update, lr, scalars_ready, delayed)
        if delayed:
            self._pending, self._upload_due = task, True
        else:
            self._upload()
            task.result()
        # the next zero_grad must not clear shards still being copied down
        if self.copy_stream is not None:  # (CUDA)
            torch.cuda.current_stream(self.copy_stream.device).wait_stream(self.copy_stream)
        return self.found

    def _scalars_down(self, grad_scale: torch.Tensor,
                      skip: torch.Tensor | None) -> torch.cuda.Event | None:
        """[grad_scale, skip] into host memory (asynchronously on a GPU); returns the
        CUDA event to wait for, or None."""
        vals = torch.stack([grad_scale.reshape(()).double(),
                            torch.zeros((), dtype=torch.float64, device=grad_scale.device)
                            if skip is None else skip.reshape(()).double()])
        stream = self.copy_stream
        ev = stream_copy(self._scalars, vals, stream)
        if stream is not None:  # (vals is freed here: the copy stream still reads it)
            vals.record_stream(stream)
        return ev

    def _update(self, lr: float, scalars_ready: Waitable | None, delayed: bool) -> None:
        """The worker: one step of AdamW over the host shard, unit by unit (last to first
        when ``delayed``: [Note: the delayed update runs last to first])."""
        if scalars_ready is not None:
            scalars_ready.synchronize()
        self._skipped = bool(self._scalars[1].item())  # host memory: no device sync
        sc = self.opt.begin_step(self._scalars[0], self._scalars[1])
        try:
            if self.speculative is not None:  # (kept for chunk_steps to judge, unless skipped)
                self.speculative.end(keep=not self._skipped)
            if not self._skipped:
                self.grads.wait_all()  # (swapped: every unit's gradient on disk)
                k = len(self._chunks)
                order = range(k - 1, -1, -1) if delayed else range(k)
                self._ends = self._reverse_ends if delayed else self._forward_ends
                steps = self.opt.chunk_steps(self._flat_grad, lr, sc, self.found, order)
                with contextlib.closing(steps):  # (an error mid-step: the tiles' I/O drains)
                    for chunk in steps:
                        chunk.apply(self._before_chunk(chunk.k))
                        self._after_chunk(chunk.k)
        except BaseException:
            self._failed = True  # nobody may wait for a unit that will not come
            raise
        finally:
            for i in range(len(self.units)):
                self._consumed[i].set()
                self._ready[i].set()

    def _before_chunk(self, k: int) -> torch.Tensor | None:
        """The gradients chunk ``k`` reads have arrived, and the parameters it
        overwrites (``out``, or the fp32 master) have been read out by their upload.
        Returns where the chunk's new parameters go (None: only into the master)."""
        for i in self._chunk_units[k][0]:
            if self._down[i] is not None:
                self._down[i].synchronize()
            if self._up[i] is not None:
                self._up[i].synchronize()
        out = self.writer.out_for(k) if self.writer is not None else (
            None if self.out is None else self.out[slice(*self._chunks[k])])
        self._chunk_t0 = time.perf_counter()
        return out

    def _after_chunk(self, k: int) -> None:
        """The units that end in chunk ``k`` are updated: upload them, and their host
        gradient buffers may be rewritten."""
        self.adam_s += time.perf_counter() - self._chunk_t0
        if self.writer is not None:
            self.writer.deliver(k)
        for i in self._ends[k]:
            self._consumed[i].set()
            self._ready[i].set()

    def _upload(self) -> None:
        """Each unit's new parameters up as soon as the worker has them."""
        for i, u in enumerate(self.units):
            self._ready[i].wait()
            if self._skipped or self._failed:  # (a failure is raised by the step)
                continue  # nothing changed: the device already holds these parameters
            if self.writer is None or self.homes[i] is None:  # (else the worker sent it home)
                self._copy_up(u, i, self._source(i))
            self.publisher.publish(u)
        self._upload_due = False

    def _source(self, i: int) -> torch.Tensor:
        """Host memory holding unit ``i``'s new parameters, to upload from."""
        src = None if self.writer is None else self.writer.source(i)
        if src is not None:
            return src
        full = self.out if self.out is not None else self.master
        assert full is not None  # (no upload copy: the fp32 master uploads itself)
        return self._piece(full, i)

    def _fill_upload_copies(self) -> None:
        """The host copies of the new parameters (``out``, or the home-less units' under
        the home writer) <- the master, rounded to the training dtype."""
        if self.out is not None:
            self.opt.master_into(self.out)
        elif self.writer is not None and self.writer.out is not None:
            for i in range(len(self.units)):
                dst = self.writer.source(i)
                if dst is not None:
                    dst.copy_(self.opt.master_range(self.bounds[i], self.bounds[i + 1]))

    def _copy_up(self, u: FlatUnit, i: int, piece: torch.Tensor) -> None:
        home = self.homes[i]
        if home is not None:  # stage 3 parameter offload: the new shard goes home
            self._up[i] = home.store(piece)
            return
        if self.cuda:  # on the compute stream: what reads the shard next is ordered after it
            u.shard.copy_(piece, non_blocking=True)
            self._up[i] = torch.cuda.Event()
            self._up[i].record()
        else:
            u.shard.copy_(piece)

    def discard_step(self) -> None:
        """The engine skipped this step before the optimizer (dynamic fp16 overflow):
        the gradients sent down are not needed, their buffers are free again."""
        self._drop_speculation()  # (the step is skipped: nothing to keep)
        self._sent = [False] * len(self.units)
        self._written = [False] * len(self.units)
        for e in self._consumed:
            e.set()
        if self.copy_stream is not None:  # (CUDA)
            torch.cuda.current_stream(self.copy_stream.device).wait_stream(self.copy_stream)

    # -- outside the step ---------------------------------------------------------------
    def wait(self) -> None:
        """Let the update in flight finish: the master and moments are then current
        (its parameters still go up at the next step, as without the wait). A
        speculative update not yet used is discarded (the step recomputes it)."""
        self._wait_update()
        self._drop_speculation()

    def _drop_speculation(self) -> None:
        if self.speculative is not None:
            self.speculative.abandon()
            self.speculative.end(keep=False)

    def _wait_update(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    @torch.no_grad()
    def upload_master(self) -> None:
        """The master (e.g. just loaded from a checkpoint) becomes the parameters."""
        self.wait()
        self._upload_due = False
        for i, up in enumerate(self._up):  # the copies about to be refilled are read out
            if up is not None:
                up.synchronize()
                self._up[i] = None
        self._fill_upload_copies()
        for i, u in enumerate(self.units):
            home = self.homes[i]
            if self.writer is not None and home is not None:  # one unit's shard at a time
                lo, hi = self.bounds[i], self.bounds[i + 1]
                event = home.store(self.opt.master_range(lo, hi).to(u.shard.dtype))
                if event is not None:
                    event.synchronize()
            else:
                self._copy_up(u, i, self._source(i))

    def seconds(self, io: AsyncIO | None) -> dict:
        """Seconds summed over the steps so far: ``host_step`` (the main thread in
        :meth:`step`), ``adam`` (the worker in the Adam kernels), ``update_wait`` (the
        main thread in backward, waiting for the update in flight to have read a gradient
        buffer: the delayed update's) and ``io_wait`` (threads blocked on ``io``'s swap
        reads and writes; 0 without swap files); where the speculative update runs,
        ``speculate`` (the worker in it, before the step)."""
        spec = {} if self.speculative is None else {"speculate": self.speculative.seconds}
        return {"host_step": self.step_s, "adam": self.adam_s,
                "update_wait": self.update_wait_s,
                "io_wait": 0.0 if io is None else io.waited.s, **spec}

    def nbytes(self) -> int:
        own = self.grads.nbytes()
        own += 0 if self.writer is None else self.writer.nbytes()
        own += 0 if self.speculative is None else self.speculative.nbytes()
        return own + (0 if self.out is None else self.out.untyped_storage().nbytes())


# -- which units a chunk finishes, in either order --------------------------------------
# The step updates the flat shard a chunk at a time: a unit per chunk on the cpu tier, a
# tile that may straddle units on the nvme tier. After each chunk it lets go of the units
# it has finished: their host gradient buffers may be rewritten, their new parameters may
# go up. ([Note: the delayed update runs last to first])
def reverse_ends(chunks: list[tuple[int, int]], bounds: list[int]) -> list[list[int]]:
    """Per chunk, when the chunks run last to first: the units whose every element is
    updated once it is (those that start in it; an empty one, at its start)."""
    out, todo = [], len(bounds) - 2
    for lo, _ in reversed(chunks):
        ends = []
        while todo >= 0 and bounds[todo] >= lo:
            ends.append(todo)
            todo -= 1
        out.append(ends)
    return out[::-1]


def chunk_units(chunks: list[tuple[int, int]], bounds: list[int]
                ) -> list[tuple[list[int], list[int]]]:
    """Per chunk ``[lo, hi)`` of the flat shard: (the units it overlaps, the units
    whose last element it holds). ``bounds[i]``: where unit ``i`` starts."""
    out, done = [], 0
    for lo, hi in chunks:
        first = max(0, bisect.bisect_right(bounds, lo) - 1)
        touches = []
        for i in range(first, len(bounds) - 1):
            if bounds[i] >= hi:
                break
            if bounds[i + 1] > lo:
                touches.append(i)
        ends = []
        while done < len(bounds) - 1 and bounds[done + 1] <= hi:
            ends.append(done)
            done += 1
        out.append((touches, ends))
    return out
