"""What the training loop measures per iteration, without making the host wait each time.

    timer = IterationTimer(device)
    pending = PendingSteps()
    for each iteration:
        timer.start(); ...; result = engine.step(lr); timer.stop()
        pending.add(iteration, result)
        for it, res, skipped in pending.settle(force=is_log_line):   # skipped: a bool
            ...
    seconds = timer.elapsed_s()   # at the log line: the one wait per interval

[Note: one wait per log interval]
Reading a device value (a loss, a norm, "was this step skipped?") makes the
host wait until the device has finished the iteration; doing it every
iteration leaves the GPU idle while the host prepares the next one. So the
loop keeps the loss and the grad norm as device tensors until the log line,
times iterations with CUDA events read at the log line, and lets the skip
flags of bf16/fp32 steps (decided on the device, see the engine's [Note: one
skip decision]) pile up until a point that reads anyway: the log line, a
checkpoint (never save a step that went non-finite), the end. The steps are
then replayed in order, so consecutive-skip counting gives the same answer
as reading every flag at once -- it is only reported later, by at most one
log interval. fp16 steps with dynamic loss scaling bring a host bool already
(``StepResult.host_skipped``: the scale had to be adjusted), and pass straight
through.
"""

from __future__ import annotations

import time

import torch


class IterationTimer:
    """Summed wall time of the iterations between :meth:`start` and :meth:`stop`.

    On a GPU, CUDA events recorded on the current stream (no host wait until
    :meth:`elapsed_s`); on the CPU, ``time.perf_counter``.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None  # on a GPU
        self._t0 = 0.0  # on the CPU
        self._cpu_s = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            assert self._start is not None, "stop() without start()"
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._start, end))
        else:
            self._cpu_s += time.perf_counter() - self._t0

    def elapsed_s(self) -> float:
        """Seconds over the iterations timed since the last call (waits for the last)."""
        if not self.cuda:
            total, self._cpu_s = self._cpu_s, 0.0
            return total
        if not self._spans:
            return 0.0
        self._spans[-1][1].synchronize()
        total = sum(a.elapsed_time(b) for a, b in self._spans) / 1000.0
        self._spans = []
        return total


class PendingSteps:
    """Step results whose skip flag the host has not read yet, in iteration order."""

    def __init__(self) -> None:
        self._steps: list = []  # (iteration, StepResult)

    def add(self, iteration: int, result) -> None:
        self._steps.append((iteration, result))

    def settle(self, force: bool) -> list:
        """``[(iteration, result, skipped as a bool)]`` for the steps held so far, in
        order: all of them when ``force`` or when the host knows every flag already
        (``result.host_skipped``; one read for the whole batch otherwise); nothing
        yet if not."""
        steps = self._steps
        on_device = [r.skipped for _, r in steps if r.host_skipped is None]
        if on_device and not force:
            return []
        flags = iter(torch.stack(on_device).tolist()) if on_device else iter(())
        self._steps = []
        return [(it, r, r.host_skipped if r.host_skipped is not None else bool(next(flags)))
                for it, r in steps]
