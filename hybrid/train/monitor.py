"""The one place that reads the metrics dict: console line, ``--log-json``, TensorBoard.

Only global rank 0 writes. Each logged iteration becomes one console line
(Megatron's format), one JSON object per line with ``--log-json PATH``, and
TensorBoard scalars with ``--tensorboard-dir DIR`` (every numeric field; dict
fields such as ``comm_bytes`` become ``comm_bytes/all_reduce`` ...). Evaluations
are logged with a ``split`` key (JSON) and under ``valid/``, ``test/`` (TensorBoard).
"""

from __future__ import annotations

import json
import logging
import math
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


def _scalars(prefix: str, m: dict):
    for k, v in m.items():
        if isinstance(v, dict):
            yield from _scalars(f"{prefix}{k}/", v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration":
            yield prefix + k, float(v)


class Monitor:
    def __init__(self, rank: int, log_json: str | None = None,
                 tensorboard_dir: str | None = None, append: bool = False,
                 log_throughput: bool = False):
        """``log_throughput``: the console line also shows TFLOP/s per rank
        (Megatron's ``--log-throughput``; JSON and TensorBoard always carry it)."""
        self.enabled = rank == 0
        self.log_throughput = log_throughput
        self._json = self._tb = None
        # Why a log could not be opened ("--log-json PATH: ..."), else None. Set, not
        # raised: only rank 0 opens the files, and the caller must tell every rank
        # (hybrid.parallel.agree.agree_error) so none is left waiting in a collective.
        self.error: str | None = None
        if not self.enabled:
            return
        if tensorboard_dir:  # first: a failure here must not have truncated the JSON log
            from torch.utils.tensorboard import SummaryWriter
            try:
                self._tb = SummaryWriter(tensorboard_dir)
            except OSError as e:
                self.error = f"--tensorboard-dir {tensorboard_dir}: cannot write there ({e})"
                return
        if log_json:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
                self._json = open(  # noqa: SIM115 - held for the run; close() ends it
                    log_json, "a" if append else "w", encoding="utf-8")
            except OSError as e:
                self.error = f"--log-json {log_json}: cannot open for writing ({e})"

    def _write(self, record: dict, prefix: str, step: int) -> None:
        if self._json is not None:
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()
        if self._tb is not None:
            for tag, v in _scalars(prefix, record):
                self._tb.add_scalar(tag, v, step)
            self._tb.flush()

    def log_iteration(self, m: dict) -> None:
        """``m`` holds iteration, train_iters, consumed_samples, loss, lr, grad_norm,
        step_time_s, tokens_per_sec, and optionally loss_scale, skipped_iterations,
        tflops_per_rank, peak_memory_bytes, model_state_bytes, comm_bytes,
        activation_checkpoint_bytes, the fastest and slowest rank's step and busy
        time: step_time_{min,max}_{s,rank}, busy_time_{min,max}_{s,rank}, and ``moe``: per
        MoE layer its routing's numbers (:class:`hybrid.train.moe_stats.MoEWatch`)."""
        if not self.enabled:
            return
        parts = [f" iteration {m['iteration']:8d}/{m['train_iters']:8d}",
                 f"consumed samples: {m['consumed_samples']:10d}",
                 f"elapsed time per iteration (ms): {m['step_time_s'] * 1000:.1f}",
                 f"learning rate: {m['lr']:.3E}", f"lm loss: {m['loss']:.6E}"]
        if "loss_scale" in m:
            parts.append(f"loss scale: {m['loss_scale']:.1f}")
        parts.append(f"grad norm: {m['grad_norm']:.3f}")
        if "skipped_iterations" in m:
            parts.append(f"number of skipped iterations: {m['skipped_iterations']:3d}")
        if "global_batch_size" in m:
            parts.append(f"global batch size: {m['global_batch_size']:5d}")
        parts.append(f"tokens/s: {m['tokens_per_sec']:.0f}")
        if "tflops_per_rank" in m and self.log_throughput:
            parts.append(f"TFLOP/s per rank: {m['tflops_per_rank']:.3f}")
        if "peak_memory_bytes" in m:
            parts.append(f"peak memory (MB): {m['peak_memory_bytes'] / 2**20:.0f}")
        for name, what in (("step_time", "step time"), ("busy_time", "busy time")):
            if f"{name}_max_s" in m:  # fastest and slowest rank (hybrid/train/stragglers.py)
                parts.append(f"{what} min/max (ms): {m[name + '_min_s'] * 1000:.1f} (rank "
                             f"{m[name + '_min_rank']}) / {m[name + '_max_s'] * 1000:.1f} "
                             f"(rank {m[name + '_max_rank']})")
        for key in ("time_breakdown_s", "offload_time_s"):  # rank 0's, per step
            if m.get(key):
                parts.append(", ".join(f"{k} (ms): {v * 1000:.1f}" for k, v in m[key].items()))
        for layer, v in (m.get("moe") or {}).items():  # (hybrid/train/moe_stats.py)
            parts.append(f"moe {layer.replace('_', ' ')}: aux loss {v['aux_loss']:.4f}, "
                         f"z loss {v['z_loss']:.4f}, tokens/expert "
                         f"{v['tokens_per_expert_min']:.0f}-{v['tokens_per_expert_max']:.0f}, "
                         f"dropped {v['dropped_per_step']:.0f}")
        if m.get("offload_speculation"):  # rank 0's tiles, over the interval
            parts.append("speculative tiles: " + ", ".join(
                f"{k} {v}" for k, v in m["offload_speculation"].items()))
        log.info(" | ".join(parts) + " |")
        self._write(m, "train/", m["iteration"])

    def log_eval(self, iteration: int, split: str, loss: float) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(loss, 50.0))
        log.info("-" * 80 + f"\n {split} loss at iteration {iteration} | lm loss: {loss:.6E} "
                 f"| lm loss PPL: {ppl:.6E} |\n" + "-" * 80)
        self._write({"iteration": iteration, "split": split, "loss": loss, "ppl": ppl},
                    f"{split}/", iteration)

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
            self._json = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
