"""``--timing-breakdown`` (DeepSpeed's ``wall_clock_breakdown``): forward, backward,
pipeline-message and optimizer seconds per step on the log line.

Off by default because on a GPU an honest split needs a device sync at every
phase boundary (the phases are asynchronous otherwise), which costs the overlap
the step is built for; on a CPU the boundaries cost nothing. One object per run,
made only with the flag; without it the step is given no clock and times nothing
(which phase each action counts to: hybrid/pipeline/step.py, [Note: what the watch
sees]).
"""

from __future__ import annotations

import contextlib
import time

import torch


class PhaseClock:
    """Seconds per phase, summed until :meth:`take` (which averages over ``steps``)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def take(self, steps: int) -> dict:
        out = {k: v / max(steps, 1) for k, v in self.seconds.items()}
        self.seconds = {}
        return out
