"""The measured half of a log line, accumulated over the iterations since the last one.

Rank-local until :meth:`IntervalMetrics.line`: the loss stays a device tensor
and the timer uses CUDA events, so an iteration makes the host wait for
nothing (:mod:`hybrid.train.step_stats`, [Note: one wait per log interval]).
"""

from __future__ import annotations

import torch

from hybrid.config.model import ModelConfig
from hybrid.config.stage_split import StageSplit
from hybrid.parallel.agree import max_over_ranks
from hybrid.parallel.state import ParallelState
from hybrid.train.setup import memory_bytes
from hybrid.train.step_stats import IterationTimer
from hybrid.train.stragglers import straggler_fields


def stage_flops_per_token(model_cfg: ModelConfig, tp: int, split: StageSplit | None,
                          pp_rank: int) -> float:
    """Training FLOPs per token of pipeline rank ``pp_rank``'s stage under ``split`` (its
    chunks' layers, the output layer if it holds the loss; the whole model without a
    split, or at PP 1): summed over the pipeline ranks, the whole model's."""
    if split is None or split.pp == 1:
        return model_cfg.flops_per_token(tp)
    ids = [i for c in range(split.vpp) for i in split.layer_ids(pp_rank, c)]
    return model_cfg.stage_flops_per_token(tp, ids,
                                           last=split.holds_loss(pp_rank, split.vpp - 1))


class IntervalMetrics:
    """Loss, time, tokens, blocked time and traffic of the iterations between log lines.

    ``flops_per_token``: the training FLOPs per token of this rank's pipeline stage (the
    whole model at PP 1), shared by the stage's TP, CP and DP ranks (TFLOP/s per rank);
    ``memory_before_model``, ``setup_peak``: this rank's bytes before the model was
    built and its peak after setup, reported beside the running peak.
    """

    def __init__(self, ps: ParallelState, flops_per_token: float, memory_before_model: int,
                 setup_peak: int):
        self.ps, self.flops_per_token = ps, flops_per_token
        self.memory_before_model, self.setup_peak = memory_before_model, setup_peak
        self.timer = IterationTimer(ps.device)
        self.loss = torch.zeros((), device=ps.device)
        self.iterations, self.tokens, self.waited = 0, 0, 0.0
        self.comm: dict = {}  # bytes per collective kind of the last iteration
        self._wait0 = 0.0
        self._comm0: dict = {}

    def start(self) -> None:
        """An iteration begins."""
        self.timer.start()
        self._wait0, self._comm0 = self.ps.comm_stats.wait_s, self.ps.comm_stats.snapshot()

    def stop(self, loss: torch.Tensor, tokens: int) -> None:
        """It ended with this rank's ``loss`` (a device scalar) over ``tokens`` tokens of
        the global batch."""
        stats = self.ps.comm_stats
        self.comm = {k: v - self._comm0[k] for k, v in stats.snapshot().items()}
        self.timer.stop()
        self.waited += stats.wait_s - self._wait0  # blocked in collectives (stragglers.py)
        self.loss += loss
        self.iterations += 1
        self.tokens += tokens

    def line(self) -> dict:
        """The interval's loss (mean over iterations and DP), time per step, tokens/s (of
        the global batch), TFLOP/s per rank (its own stage's work), memory peaks (the
        largest rank's), the last iteration's traffic, and the slowest and fastest rank;
        then start a new interval. Collective: one all-reduce over DP, a max and an
        all-gather of a few floats over the world."""
        ps, n = self.ps, self.iterations
        ps.dp_group.all_reduce(self.loss)  # mean over DP replicas, once per log line
        elapsed = self.timer.elapsed_s()
        step_time = elapsed / n
        peaks = max_over_ranks(ps, [memory_bytes(ps)[1], self.setup_peak,
                                    self.memory_before_model])
        m = {"loss": float(self.loss) / (n * ps.dp_size), "step_time_s": step_time,
             "tokens_per_sec": self.tokens / elapsed,
             "tflops_per_rank": self.flops_per_token * self.tokens / elapsed
             / (ps.world_size // ps.pp_size) / 1e12,
             **dict(zip(("peak_memory_bytes", "setup_peak_memory_bytes",
                         "memory_before_model_bytes"), map(int, peaks))),
             "comm_bytes": self.comm,
             **straggler_fields(ps, step_time, (elapsed - self.waited) / n)}
        self.loss.zero_()
        self.iterations, self.tokens, self.waited = 0, 0, 0.0
        return m
