#!/usr/bin/env python
"""Step time of a GPT in bf16 (or fp16) against fp32 on this CPU, forward / backward /
optimizer apart. One process, ZeRO-0, one intra-op thread unless --threads.

    python -m benchmarks.bench_bf16_cpu [--modes fp32 bf16 bf16:eager] [--layers 12]

Modes: ``fp32``; ``bf16`` / ``fp16`` (the linear path hybrid picks for this CPU:
``hybrid.kernels.select``); ``bf16:eager`` / ``bf16:fp32`` (that path forced, as
``--kernel-choice linear=...`` does). The modes' steps are interleaved, one step
of each in turn, so the machine's drift hits all alike; each figure is the
median over ``--steps`` steps after ``--warmup``. Prints one JSON object: the
CPU's native bf16/fp16 support as hybrid detects it, ``ONEDNN_MAX_CPU_ISA``
(set it to ``AVX2`` to see a CPU without native bf16 on one that has it),
per mode the median seconds of forward, backward and optimizer step, and the
step time over fp32's. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any

import torch

from benchmarks.timing import emit, median_of, now
from hybrid.config import build_config, kernel_config_from_env
from hybrid.config.flags import Flags
from hybrid.config.sections import KernelConfig
from hybrid.kernels import configure, kernel_choice
from hybrid.kernels.cpu_features import native_cpu_matmul
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import seed_all
from hybrid.train.setup import build_engine

VOCAB = 50257


class _Mode:
    """One engine and the kernel settings its steps run under."""

    def __init__(self, name: str, a, ps: ParallelState, base: KernelConfig):
        dtype, _, path = name.partition(":")
        flags: dict[str, Any] = {"bf16": {"bf16": True}, "fp16": {"fp16": True}, "fp32": {}}[dtype]
        cfg = build_config(Flags(num_layers=a.layers, hidden_size=a.hidden,
                    num_attention_heads=a.heads, seq_length=a.seq,
                    micro_batch_size=a.micro_batch, hidden_dropout=0.1,
                    attention_dropout=0.1, **flags), 1)
        self.name, self.cfg = name, cfg
        self.kernels = replace(base, choice=base.choice + ((("linear", path),) if path else ()))
        rng = seed_all(cfg.seed, 0, 0, ps.device)
        self.model, _, self.engine = build_engine(cfg, ps, VOCAB, rng)
        self.times: list[tuple[float, float, float]] = []  # (forward, backward, optimizer)
        configure(self.kernels)
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
        self.linear_path = kernel_choice("linear", ps.device, low) if low else "eager"

    def step(self, tokens, labels) -> None:
        configure(self.kernels)
        t0 = now()
        self.engine.zero_grad()
        loss = self.model(tokens, labels)
        t1 = now()
        self.engine.backward(loss)
        t2 = now()
        self.engine.step(1e-4)
        t3 = now()
        self.times.append((t1 - t0, t2 - t1, t3 - t2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = kernel_config_from_env(os.environ)  # this script's entry point: HYBRID_* settings
    ps = ParallelState.single()
    modes = [_Mode(m, a, ps, base) for m in a.modes]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (a.micro_batch, a.seq + 1), generator=g)
    for _ in range(a.warmup + a.steps):
        for m in modes:
            m.step(x[:, :-1], x[:, 1:])
    out = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "native_bf16": native_cpu_matmul(torch.bfloat16),
           "native_fp16": native_cpu_matmul(torch.float16),
           "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA"),
           "threads": a.threads, "shape": {"layers": a.layers, "hidden": a.hidden,
                                           "seq": a.seq, "micro_batch": a.micro_batch,
                                           "vocab": VOCAB},
           "steps": a.steps, "modes": {}}
    for m in modes:
        kept = m.times[a.warmup:]
        med = [median_of(t[i] for t in kept) for i in range(3)]
        out["modes"][m.name] = {"linear_path": m.linear_path,
                                "forward_s": round(med[0], 3), "backward_s": round(med[1], 3),
                                "optimizer_s": round(med[2], 3),
                                "step_s": round(median_of(sum(t) for t in kept), 3)}
    ref = out["modes"].get("fp32")
    if ref:
        for r in out["modes"].values():
            r["step_over_fp32"] = round(r["step_s"] / ref["step_s"], 2)
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
