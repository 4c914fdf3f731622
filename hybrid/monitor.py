"""The one place that reads the metrics dict: console line and ``--log-json``.

Only global rank 0 writes. Each logged iteration becomes one console line
(Megatron's format) and, with ``--log-json PATH``, one JSON object per line.
"""

from __future__ import annotations

import json
import logging
import os
import sys

log = logging.getLogger("hybrid")


def setup_logging(rank: int) -> None:
    """INFO on rank 0, warnings only elsewhere, so a job prints each line once."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class Monitor:
    def __init__(self, rank: int, log_json: str | None = None):
        self.enabled = rank == 0
        self._json = None
        if self.enabled and log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            self._json = open(log_json, "w", encoding="utf-8")

    def log_iteration(self, m: dict) -> None:
        """``m`` holds iteration, train_iters, consumed_samples, loss, lr, grad_norm,
        step_time_s and tokens_per_sec (and whatever other components add)."""
        if not self.enabled:
            return
        log.info(" iteration %8d/%8d | consumed samples: %10d | elapsed time per iteration "
                 "(ms): %.1f | learning rate: %.3E | lm loss: %.6E | grad norm: %.3f | "
                 "tokens/s: %.0f |", m["iteration"], m["train_iters"], m["consumed_samples"],
                 m["step_time_s"] * 1000, m["lr"], m["loss"], m["grad_norm"],
                 m["tokens_per_sec"])
        if self._json is not None:
            self._json.write(json.dumps(m) + "\n")
            self._json.flush()

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
            self._json = None
