#!/usr/bin/env python
"""Peak memory per rank against the estimator, for one GPT at several DP sizes (JSON lines).

    python -m benchmarks.bench_memory             # 302M GPT, ZeRO-3, bf16, recompute, DP 1 2 4
    python -m benchmarks.bench_memory --precision fp32 --no-recompute
    python -m benchmarks.bench_memory --hidden-size 1536 --dp 4 --precision fp32  # 700M startup

Each DP size is a real run of scripts/pretrain_gpt.py under torchrun (2
iterations, fresh processes, so peaks are this run's). Per DP size it prints
the measured model-state bytes, the largest rank's peak memory after setup and
after the 2 steps (RSS on the CPU, max_memory_allocated on a GPU), the memory
the process held before the model existed (runtime + data), and the
estimator's prediction (``hybrid.estimate.memory.peak_memory``, given that
pre-model memory). A last line says whether every peak is within model states +
activations + 0.6 GB and within 10% of the prediction, and gives the DP4
peak over the DP1 peak (the 302M run is meant to keep it at most 0.35).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks.timing import emit
from hybrid.config import build_config, parse_args
from hybrid.estimate.memory import activation_bytes, peak_memory, workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 2 ** 30
BYTE_VOCAB = 257  # the built-in corpus's byte tokenizer


def flags(a, dp: int) -> list[str]:
    """pretrain_gpt.py's flags for one run at data-parallel size ``dp``."""
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads),
            "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.micro_batch_size * dp),
            "--zero-stage", str(a.zero_stage), "--train-iters", "2", "--log-interval", "1",
            "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            *(["--bf16"] if a.precision == "bf16" else []),
            *(["--recompute-granularity", "full"] if a.recompute else []), *a.extra]


def run(argv: list[str], dp: int, log: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(dp), os.path.join(ROOT, "scripts", "pretrain_gpt.py"),
           *argv, "--log-json", log]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, check=False, text=True, env=env)
    if r.returncode:
        sys.exit(f"bench_memory: DP {dp} failed:\n{r.stderr[-3000:]}")
    with open(log, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip() and "split" not in line]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-layers", type=int, default=24)
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--num-attention-heads", type=int, default=16)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--zero-stage", type=int, default=3)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                    help="--recompute-granularity full (as ZeRO-3 runs use)")
    ap.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags, after --")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    peaks, near, predicted = {}, [], []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in a.dp:
            argv_dp = flags(a, dp)
            m = run(argv_dp, dp, os.path.join(tmp, f"dp{dp}.jsonl"))[-1]
            w = workload(build_config(parse_args(argv_dp), dp), BYTE_VOCAB, device)
            runtime = m["memory_before_model_bytes"]
            pred = peak_memory(w, runtime)
            states, peak = m["model_state_bytes"]["total"], m["peak_memory_bytes"]
            acts = activation_bytes(w)["peak"]
            peaks[dp] = peak
            error = pred["total"] / peak - 1
            over = (peak - states - acts) / GB
            near.append(over <= 0.6)
            predicted.append(abs(error) <= 0.10)
            emit({
                "params": w.psi, "dp": dp, "zero_stage": w.zero_stage,
                "params_dtype": w.params_dtype, "recompute": w.recompute, "device": device,
                "model_state_bytes": states, "activation_bytes_estimated": acts,
                "memory_before_model_bytes": runtime,
                "setup_peak_bytes": m["setup_peak_memory_bytes"],
                "peak_after_2_steps_bytes": peak, "predicted_peak_bytes": pred["total"],
                "predicted": pred, "prediction_error": round(error, 4),
                "peak_minus_states_and_activations_gb": round(over, 3),
                "step_time_s": m["step_time_s"]})
    summary = {"peaks_within_states_activations_plus_0.6gb": all(near),
               "predictions_within_10pct": all(predicted)}
    if 1 in peaks and 4 in peaks:
        summary["dp4_peak_over_dp1_peak"] = round(peaks[4] / peaks[1], 4)
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
