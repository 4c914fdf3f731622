"""The host step's speculative update of the nvme tier's read-ahead tiles.

Under a pipeline a stage whose backward ends first waits for the others before its step
knows its clip coefficient and skip decision. This updates the tiles the step reads
first meanwhile, on the host step's worker, as the step will if the clip does not bind
and the step is not skipped; the step keeps the update only if its scalars turn out to
be those, bit for bit ([Note: what starts before the step] in
hybrid/zero/offload/host_step.py, which owns the contract; the tiles' side is
[Note: holding read-ahead tiles] in tiles.py).

[Note: a speculation the step has outrun]
The step posts its scalars as soon as it has them (:meth:`SpeculativeUpdate.post`), and
a skip decided on the main thread abandons the speculation (:meth:`abandon`). The worker
looks before each tile: once the scalars are known not to be the speculation's, it stops
and lets the tiles go instead of updating the rest for nothing -- a speculation the clip
outruns costs what it had done, not all of it. The check reads the same fp64 values the
step's ``begin_step`` takes, so it decides as the step's own comparison would; either
way, a tile is kept only by that comparison (:meth:`SwappedAdamW.chunk_steps`).

[Note: sitting out while the clip binds]
A discarded speculation is not free where the stages share cores and a disk: on the
2-core machine, with every step's clip binding, it made the step 0.1-0.3 s longer. And a
clip that bound last step most likely binds again: early in training the norm stays
above ``--clip-grad`` for many steps, later below it. So after a speculation the step did
not use (its clip bound, or it was skipped) the next steps do not speculate: 1 step
after the first such, then 2, 4, ... up to :data:`MAX_SIT_OUT`; a speculation that is
used again resets it. A step that does not speculate updates every
tile as before, so the numbers do not depend on it; the waste of a binding clip falls
from every step to one step in ``MAX_SIT_OUT + 1`` once the sit-outs have grown.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hybrid.zero.offload.contracts import Waitable
from hybrid.zero.offload.nvme.adamw import SwappedAdamW
from hybrid.zero.offload.nvme.grads import SwappedGrads

MAX_SIT_OUT = 64  # steps, the longest wait between two tries while the clip binds


class SpeculativeUpdate:
    """The speculative update of ``opt``'s read-ahead tiles, run on ``worker`` (the host
    step's one thread, so the step's own update, submitted after, runs after it).

    Args:
        opt: the nvme tier's optimizer, its states' gradients attached (``grads``).
        grads: where the gradients land; a unit's last ``store`` of a step is final.
        worker: the host step's worker.
        touches: per tile, the units it overlaps.
        dtype, pin: the parameters' training dtype; page-locked buffers.
    """

    def __init__(self, opt: SwappedAdamW, grads: SwappedGrads, worker: ThreadPoolExecutor,
                 touches: list[list[int]], *, dtype: torch.dtype, pin: bool):
        self.opt, self.grads, self.worker, self.touches = opt, grads, worker, touches
        self.dtype, self.pin = dtype, pin
        self._task: Future[None] | None = None
        self._outs: list[torch.Tensor] = []  # the held tiles' new parameters, one tile each
        self._posted = threading.Event()  # the step's verdict is known ([Note: a ...])
        self._verdict: tuple | None = None  # (CUDA event or None, scalars, lr); None: drop
        self.seconds = 0.0  # the worker in it
        # [Note: sitting out while the clip binds]: the steps still to sit out, the next
        # sit-out's length, and the "used" count when the last speculation started (None:
        # its outcome already judged, or none started)
        self._sit_out, self._next_sit_out = 0, 1
        self._used_at_start: int | None = None

    def start(self, lr: float, grad_scale: float, final: list[bool]) -> None:
        """After the read-ahead (between steps, main thread): update the leading read-ahead
        tiles whose units' gradients are ``final`` (sent down; a tied unit's waits for the
        step's sum and ends the run) with ``lr``, clip coefficient 1 (``ones / grad_scale``
        in fp64, the step's own division after its ``clamp(..., max=1.0)``) and no skip."""
        if self._task is not None:
            return
        if self._used_at_start is not None:  # the last speculation's outcome ([Note: sitting
            used = self.opt.speculation["used"] > self._used_at_start  # out ...])
            self._used_at_start = None
            if used:
                self._next_sit_out = 1
            else:
                self._sit_out = self._next_sit_out
                self._next_sit_out = min(2 * self._next_sit_out, MAX_SIT_OUT)
        if self._sit_out:
            self._sit_out -= 1
            return
        count, units = 0, set()
        for k in self.opt.states.read_ahead:
            if not all(final[i] for i in self.touches[k]):
                break
            count += 1
            units.update(self.touches[k])
        if not count:
            return
        if len(self._outs) < count:
            self._outs = [torch.empty(self.opt.states.tile, dtype=self.dtype,
                                      pin_memory=self.pin) for _ in range(count)]
        coefficient = torch.ones((), dtype=torch.float64) / grad_scale
        self._posted.clear()
        self._verdict = None
        self._used_at_start = self.opt.speculation["used"]
        self._task = self.worker.submit(self._run, count, lr, coefficient, sorted(units))

    def _run(self, count: int, lr: float, coefficient: torch.Tensor, units: list[int]) -> None:
        t0 = time.perf_counter()
        try:
            self.grads.wait_units(units)  # (each unit's final gradient is on disk)
            scalars = self.opt.speculative_scalars(coefficient)
            self.opt.speculate(count, lr, scalars, self._outs,
                               stop=lambda: self._outrun(scalars, lr))
        finally:
            self.seconds += time.perf_counter() - t0

    def _outrun(self, scalars: torch.Tensor, lr: float) -> bool:
        """The worker: the step's scalars are known, and not ``scalars`` / ``lr``."""
        if not self._posted.is_set():
            return False
        if self._verdict is None:
            return True
        ready, posted, posted_lr = self._verdict
        if ready is not None:
            ready.synchronize()
        # (what begin_step makes of them: [coefficient, step, skip], the step counted)
        return (posted_lr != lr or bool(posted[1] != 0)
                or not torch.equal(posted[0].reshape(1).view(torch.int64),
                                   scalars[0].reshape(1).view(torch.int64)))

    def settle(self) -> None:
        """Wait until the speculation's task has run (tests and benches: the step never
        needs to; its own update is queued behind it on the worker)."""
        task = self._task
        if task is not None:
            task.exception()  # (waits; an error is raised by end())

    def post(self, scalars: torch.Tensor, ready: Waitable | None, lr: float) -> None:
        """The main thread: the step's fp64 ``[coefficient, skip]`` are in ``scalars`` once
        ``ready`` (a CUDA event; None: now), its ``lr``."""
        self._verdict = (ready, scalars, lr)
        self._posted.set()

    def abandon(self) -> None:
        """The main thread: nothing of the speculation will be used (a skipped step)."""
        self._verdict = None
        self._posted.set()

    def end(self, keep: bool) -> None:
        """Wait for the speculation's task and raise its error; unless ``keep``, discard
        what it holds. ``keep``: the step's tile loop judges it."""
        task, self._task = self._task, None
        try:
            if task is not None:
                task.result()
        finally:
            if not keep:
                self.opt.drop_speculation()

    def counts(self) -> dict:
        """Tiles summed over the steps so far: ``speculated`` before the step, then
        ``used`` or ``discarded`` by it."""
        return dict(self.opt.speculation)

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._outs)
