"""ZeRO-Offload's CPU optimizer step: hybrid's fused kernel against what a user has.

Prints one JSON object. For each shard size, thread count and gradient dtype:

  (a) hybrid     csrc/cpu_adam.cpp: upcast, unscale+clip, AdamW, overflow flag and the
                 bf16 parameter copy-out in one pass (fp32 rows: no copy-out, the
                 master is the parameter)
  (b) torch_ops  the same work as torch ops: grad.float(), GradScaler's fused
                 unscale+inf check, AdamW(fused=True).step(), copy-out to bf16
  (c) fused      AdamW(fused=True).step() alone on fp32 gradients
  (d) foreach    AdamW(foreach=True).step() alone on fp32 gradients
  (e) deepspeed  DeepSpeedCPUAdam.step() on fp32 (when importable and its op builds)

params/s is the median over --reps steps after one warm-up; systems alternate
within each repetition. ``bandwidth_GBps`` is a STREAM triad (a = b + s*c, 12
bytes per element) with the same threads, and ``fraction_of_triad`` counts the
bytes each system must move per parameter at least (listed in ``bytes_per_param``).

    python -m benchmarks.bench_cpu_adam                # 10M and 100M, 1 and 2 threads
    python -m benchmarks.bench_cpu_adam --sizes 10e6 --reps 5
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from benchmarks.timing import emit, interleaved, median_of
from hybrid.config import kernel_config_from_env
from hybrid.kernels import configure
from hybrid.kernels.adam import AdamSegments, adam_step, cpu_adam_ext

LR, BETAS, EPS, WD, SCALE = 1e-3, (0.9, 0.95), 1e-8, 0.1, 0.5


def _bytes(grad_bytes: int, out_bytes: int) -> dict:
    """Least bytes per parameter each system moves (reads + writes)."""
    adam = 4 * 3 * 2  # master, exp_avg, exp_avg_sq: read and write
    upcast = 0 if grad_bytes == 4 else grad_bytes + 4
    copy_out = 0 if out_bytes == 0 else 4 + out_bytes
    return {"hybrid": grad_bytes + adam + out_bytes,
            "torch_ops": upcast + 8 + 4 + adam + copy_out,
            "fused": 4 + adam, "foreach": 4 + adam, "deepspeed": 4 + adam}


def _triad_gbps(ext, reps: int) -> float:
    n = 50_000_000
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    triad = ((lambda: ext.triad(a, b, c, 3.0)) if ext is not None
             else (lambda: torch.add(b, c, alpha=3.0, out=a)))
    return 12 * n / median_of(interleaved({"triad": triad}, reps, warmup=1)["triad"]) / 1e9


def _deepspeed_factory():
    """DeepSpeedCPUAdam, or the reason it cannot run here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p = torch.nn.Parameter(torch.zeros(16))
        p.grad = torch.zeros(16)
        DeepSpeedCPUAdam([p], lr=LR).step()  # builds (or loads) its C++ op
    except Exception as e:  # not installed, or its op does not build
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"
    return (lambda params: DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS,
                                            weight_decay=WD, adamw_mode=True)), None


def _systems(n: int, grad_dtype: torch.dtype, ds_factory):
    """name -> a zero-argument callable doing one step, each on its own buffers."""
    g = torch.Generator().manual_seed(0)
    grad_lo = (torch.randn(n, generator=g) * 1e-2).to(grad_dtype)
    out_dtype = None if grad_dtype == torch.float32 else grad_dtype
    systems = {}

    master, m, v = torch.randn(n) * 0.02, torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype) if out_dtype else None
    segs = AdamSegments.from_ranges(n, [(0, n)], "cpu")
    state = {"t": 0}

    def hybrid():
        state["t"] += 1
        adam_step(master, grad_lo, m, v, out, segs, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                  eps=EPS, weight_decay=WD, step=state["t"], grad_scale=SCALE)
    systems["hybrid"] = hybrid

    p_b = torch.nn.Parameter(torch.randn(n) * 0.02)
    opt_b = torch.optim.AdamW([p_b], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    out_b = torch.empty(n, dtype=out_dtype) if out_dtype else None
    found, inv = torch.zeros(1), torch.tensor([SCALE])

    def torch_ops():
        g32 = grad_lo.float() if grad_dtype != torch.float32 else grad_lo.clone()
        torch._amp_foreach_non_finite_check_and_unscale_([g32], found, inv)
        p_b.grad = g32
        opt_b.step()
        if out_b is not None:
            out_b.copy_(p_b.detach())
    systems["torch_ops"] = torch_ops

    grad32 = grad_lo.float()
    for name, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        p.grad = grad32
        systems[name] = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS,
                                          weight_decay=WD, **kw).step
    if ds_factory is not None:
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        p.grad = grad32
        systems["deepspeed"] = ds_factory([p]).step
    return systems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10e6,100e6", help="shard sizes, comma separated")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="fp32,bf16", help="gradient dtypes: fp32,bf16,fp16")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    configure(kernel_config_from_env(os.environ))  # this script's entry point: HYBRID_* settings
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    ext = cpu_adam_ext()
    ds_factory, ds_why = _deepspeed_factory()
    report: dict[str, Any] = {"kernel": ext.build_info() if ext else "unavailable (torch fallback)",
              "torch": torch.__version__, "deepspeed": ds_why or "DeepSpeedCPUAdam",
              "rows": [], "bandwidth_GBps": {}}
    for threads in [int(x) for x in a.threads.split(",")]:
        torch.set_num_threads(threads)
        bw = _triad_gbps(ext, a.reps)
        report["bandwidth_GBps"][threads] = round(bw, 2)
        for size in [int(float(x)) for x in a.sizes.split(",")]:
            for dname in a.dtypes.split(","):
                dt = dtypes[dname]
                systems = _systems(size, dt, ds_factory)
                sec = {k: median_of(v) for k, v in interleaved(systems, a.reps, warmup=1).items()}
                width = torch.finfo(dt).bits // 8
                nbytes = _bytes(width, 0 if dt == torch.float32 else width)
                rate = {k: size / s for k, s in sec.items()}
                row = {"params": size, "threads": threads, "grad_dtype": dname,
                       "params_per_s": {k: round(r / 1e9, 3) for k, r in rate.items()},
                       "unit": "G params/s",
                       "bytes_per_param": {k: nbytes[k] for k in rate},
                       "fraction_of_triad": {k: round(r * nbytes[k] / (bw * 1e9), 3)
                                             for k, r in rate.items()},
                       "hybrid_vs": {k: round(rate["hybrid"] / r, 3)
                                     for k, r in rate.items() if k != "hybrid"}}
                report["rows"].append(row)
                emit(row, file=sys.stderr)
                del systems
    emit(report, indent=1)


if __name__ == "__main__":
    main()
