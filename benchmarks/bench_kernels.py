"""Time the fused CUDA kernels against eager PyTorch and torch.compile (GPU only).

    python -m benchmarks.bench_kernels [--iters 30] [--write-choice]

GPT-1.3B shapes: hidden 2048, ffn 8192, seq 2048 x micro-batch 4 = 8192 rows,
vocab 50304 (TP=1) and 25152 (TP=2 local). Each op is timed forward+backward
(CUDA events, warmup, median of --iters) in bf16; fused AdamW over a 100M fp32
shard (bf16 grads, bf16 copy-out) against torch._fused_adamw_ + .copy_().
Prints one JSON object: per op and path the median ms, the speedups over eager
and the fastest path ("choice"). --write-choice also prints the CUDA_CHOICE table
for hybrid/kernels/select.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.timing import emit, median_of


def median_ms(fn, iters: int, warmup: int = 5, calls: int = 10) -> float:
    """Median GPU ms per call, timing ``calls`` back-to-back calls per sample.

    Back to back, as in a training step, the host enqueues the next call while
    the GPU runs this one, so the figure is the GPU's time rather than Python's
    launch latency with an idle GPU.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return median_of(times)


def with_path(op: str, path: str, fn):
    """``fn`` with ``op`` forced onto ``path`` (what --kernel-choice op=path sets)."""
    from dataclasses import replace

    from hybrid.kernels import configure, current
    base = current()

    def run():
        configure(replace(base, choice=((op, path),)))
        try:
            fn()
        finally:
            configure(base)
    return run


MARGIN = 1.05  # a non-eager path must beat eager by 5%: ties cost compile time for nothing


def pick(times: dict) -> str:
    """Fastest path, eager unless another beats it by MARGIN."""
    if not times:
        return "eager"
    best = min(times, key=lambda path: times[path])
    if "eager" in times and times["eager"] < MARGIN * times[best]:
        return "eager"
    return best


def bench_op(op, make_fn, iters):
    out: dict[str, Any] = {}
    for path in ("eager", "compile", "fused"):
        try:
            out[path] = round(median_ms(with_path(op, path, make_fn()), iters), 4)
        except Exception as e:  # e.g. torch.compile unavailable
            out[path] = None
            out[f"{path}_error"] = f"{type(e).__name__}: {e}"[:200]
    times = {p: t for p, t in out.items() if p in ("eager", "compile", "fused") and t}
    out["choice"] = pick(times)
    for p in ("compile", "fused"):
        if out.get(p) and out.get("eager"):
            out[f"speedup_{p}"] = round(out["eager"] / out[p], 3)
    return out


ROWS, HIDDEN, FFN = 8192, 2048, 8192  # GPT-1.3B: seq 2048 x micro-batch 4 rows
DEV, BF16 = "cuda", torch.bfloat16


def layer_norm_step():
    """Inputs once; the timed step: LayerNorm forward + backward, (ROWS, HIDDEN) bf16."""
    from hybrid.kernels import layer_norm
    x = torch.randn(ROWS, HIDDEN, device=DEV, dtype=BF16, requires_grad=True)
    w = torch.ones(HIDDEN, device=DEV, dtype=BF16, requires_grad=True)
    b = torch.zeros(HIDDEN, device=DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    return lambda: layer_norm(x, w, b, 1e-5).backward(dy)


def layer_norm_forward_step():
    """LayerNorm forward alone: tells a slow backward from a slow forward."""
    from hybrid.kernels import layer_norm
    x = torch.randn(ROWS, HIDDEN, device=DEV, dtype=BF16)
    w, b = torch.ones(HIDDEN, device=DEV, dtype=BF16), torch.zeros(HIDDEN, device=DEV, dtype=BF16)
    return lambda: layer_norm(x, w, b, 1e-5)


def bias_gelu_step():
    """bias-GELU forward + backward, (ROWS, FFN) bf16, the exact GELU (the model's
    default; --openai-gelu's tanh one is the other template of the same kernel)."""
    from hybrid.kernels import bias_gelu
    x = torch.randn(ROWS, FFN, device=DEV, dtype=BF16, requires_grad=True)
    b = torch.zeros(FFN, device=DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    return lambda: bias_gelu(x, b, "none").backward(dy)


def cross_entropy_step(vocab: int):
    """A maker of one rank's vocab-parallel cross-entropy share over ``vocab`` columns:
    the softmax statistics forward, the gradient backward."""
    from hybrid.kernels import local_softmax_stats, softmax_grad

    def make():
        x = torch.randn(ROWS, vocab, device=DEV, dtype=BF16) * 4
        t = torch.randint(0, vocab, (ROWS,), device=DEV)
        g = torch.ones(ROWS, device=DEV)

        def step():
            m, s, tl = local_softmax_stats(x, t, 0, vocab)
            softmax_grad(x, t, 0, vocab, m, s, g)
        return step
    return make


def torch_cross_entropy_step():
    """What TP=1 runs without the kernel: F.cross_entropy in fp32, forward + backward."""
    x = (torch.randn(ROWS, 50304, device=DEV, dtype=BF16) * 4).requires_grad_()
    t = torch.randint(0, 50304, (ROWS,), device=DEV)
    return lambda: F.cross_entropy(x.float(), t).backward()


def bench_adam(ops, iters: int) -> dict:
    """The fused AdamW over a 100M-element fp32 shard (bf16 grads, bf16 parameter
    copy-out) against torch._fused_adamw_ + .copy_()."""
    n = 100_000_000
    p = torch.randn(n, device=DEV)
    m, v = torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)
    g16 = torch.randn(n, device=DEV, dtype=BF16)
    out = torch.empty(n, device=DEV, dtype=BF16)
    bounds = torch.tensor([0, n // 2, n], device=DEV)
    decay = torch.tensor([1, 0], device=DEV, dtype=torch.uint8)
    fi = torch.zeros(1, device=DEV)
    fused = median_ms(lambda: ops.adam_step(p, g16, m, v, out, bounds, decay, 1e-4, 0.9, 0.95,
                                            1e-8, 0.1, 10, 1.0, fi), iters)
    g32 = g16.float()  # _fused_adamw_ needs fp32 grads for fp32 params
    st = torch.tensor(10.0, device=DEV)

    def torch_adam():
        torch._fused_adamw_([p], [g32], [m], [v], [], [st], lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        out.copy_(p)
    ref = median_ms(torch_adam, iters)
    return {"fused": round(fused, 4), "torch_fused_adamw_plus_copy": round(ref, 4),
            "speedup_fused": round(ref / fused, 3),
            "choice": pick({"fused": fused, "eager": ref}),
            "fused_GBps": round(n * (4 * 6 + 2 + 2) / fused / 1e6, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--write-choice", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    from hybrid.config import kernel_config_from_env
    from hybrid.kernels import configure
    from hybrid.kernels.cuda_ops import cuda_ops
    configure(kernel_config_from_env(os.environ))  # this script's entry point: HYBRID_* settings
    ops = cuda_ops()
    if ops is None:
        sys.exit("hybrid_cuda_ops did not build; see the log line above")
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": ROWS}
    res["layer_norm"] = bench_op("layer_norm", layer_norm_step, args.iters)
    res["layer_norm_forward_only"] = bench_op("layer_norm", layer_norm_forward_step, args.iters)
    res["torch_cross_entropy_50304_ms"] = round(median_ms(torch_cross_entropy_step(),
                                                          args.iters), 4)
    res["bias_gelu"] = bench_op("bias_gelu", bias_gelu_step, args.iters)
    res["cross_entropy_50304"] = bench_op("cross_entropy", cross_entropy_step(50304), args.iters)
    res["cross_entropy_25152"] = bench_op("cross_entropy", cross_entropy_step(25152), args.iters)
    res["adam_100M"] = bench_adam(ops, args.iters)

    choice = {op: res[key]["choice"] for op, key in
              (("layer_norm", "layer_norm"), ("bias_gelu", "bias_gelu"),
               ("cross_entropy", "cross_entropy_50304"), ("adam", "adam_100M"))}
    res["choice"] = choice
    emit(res, indent=1)
    if args.write_choice:
        print("# paste into hybrid/kernels/select.py")
        print(f"CUDA_CHOICE = {choice!r}")


if __name__ == "__main__":
    main()
