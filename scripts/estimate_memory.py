#!/usr/bin/env python
"""Peak memory and DP traffic per rank of a pretrain_gpt.py run, for every ZeRO stage.

    python scripts/estimate_memory.py --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 1024 --tensor-model-parallel-size 4 \
        --micro-batch-size 4 --global-batch-size 512 --bf16 --tokenizer-type gpt2bpe \
        --world-size 32 --gpu-memory-gb 80

Takes pretrain_gpt.py's own flags (so a launch script's line can be pasted as
it is) plus the few below. Prints one JSON line per ZeRO stage: model states
(params, grads, optimizer), activations for the recompute mode in use,
ZeRO's gather and staging buffers, the predicted peak per rank
(:func:`hybrid.estimate.memory.peak_memory`) and the bytes each rank sends
per optimizer step with the run's micro-batches per step. With
``--gpu-memory-gb`` a last line names the stage with the least traffic whose
peak fits (``recommended_zero_stage``; null when none does).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from hybrid.config import Flags, build_config
from hybrid.config.flags import build_parser
from hybrid.config.sections import tokenizer_kind
from hybrid.errors import ConfigError
from hybrid.estimate.memory import (activation_bytes, buffer_bytes, choose_stage, peak_memory,
                                    traffic_bytes, workload)
from hybrid.estimate.model_states import model_state_bytes

GIB = 2 ** 30
OWN = ("world_size", "data_parallel_size", "micro_batches", "gpu_memory_gb", "runtime_gb",
       "device")
# Memory a process holds before the model: on the CPU, what scripts/bench_memory.py
# measures (memory_before_model_bytes, about 0.25 GB: interpreter, torch, gloo,
# data); on CUDA a reserve for the context, NCCL's buffers and the caching
# allocator's slack that this repository has not measured -- set --runtime-gb.
RUNTIME_GB = {"cpu": 0.25, "cuda": 1.5}


def _parser():
    ap = build_parser()
    ap.prog = "estimate_memory.py"
    ap.usage = ("%(prog)s [pretrain_gpt.py flags] [--world-size N] [--micro-batches K] "
                "[--gpu-memory-gb M] [--runtime-gb R] [--device cuda|cpu]")
    ap.description = __doc__.split("\n\n")[0]
    g = ap.add_argument_group("the estimate")
    g.add_argument("--world-size", type=int, default=None,
                   help="ranks in the job (default: TP x --data-parallel-size)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="DP size when --world-size is not given")
    g.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step (default: from --global-batch-size)")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="device memory per rank (GiB): recommend the stage that fits")
    g.add_argument("--runtime-gb", type=float, default=None,
                   help="memory per rank before the model (GiB; default 0.25 on cpu, 1.5 "
                        "on cuda)")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    ns = vars(ap.parse_args(argv))
    own = {k: ns.pop(k) for k in OWN}
    # Shapes are all an estimate needs: no tokenizer or data files are read.
    flags = dataclasses.replace(Flags(**ns), tokenizer_type="byte", data_path=None)
    tp = flags.tensor_model_parallel_size
    world = own["world_size"] or tp * own["data_parallel_size"]
    if own["micro_batches"] is not None:
        if own["micro_batches"] < 1:
            ap.error("--micro-batches must be >= 1")
        flags.global_batch_size = own["micro_batches"] * flags.micro_batch_size * (world // tp)
    try:
        cfg = build_config(flags, world)
    except ConfigError as e:
        ap.error(str(e))
    # --vocab-size N: NullTokenizer's ids (N + 1 with its eod); else taken as the vocabulary
    kind = tokenizer_kind(ns["tokenizer_type"] or ("GPT2BPETokenizer" if ns["vocab_file"]
                                                   else "byte"))
    vocab = (ns["vocab_size"] + (kind == "NullTokenizer")
             if ns["vocab_size"] else 257 if kind == "byte" else 50257)
    runtime = int((own["runtime_gb"] if own["runtime_gb"] is not None
                   else RUNTIME_GB[own["device"]]) * GIB)
    w = workload(cfg, vocab, own["device"])
    budget = own["gpu_memory_gb"] * GIB if own["gpu_memory_gb"] is not None else None
    for stage in range(4):
        ws = w.with_stage(stage)
        peak = peak_memory(ws, runtime)
        record = {
            "zero_stage": stage, "selected": stage == w.zero_stage, "tp": w.tp, "dp": w.dp,
            "micro_batches": w.micro_batches, "params_dtype": w.params_dtype,
            "grads_dtype": w.grads_dtype or w.params_dtype, "recompute": w.recompute,
            "params_per_tp_rank": w.psi,
            "model_states": model_state_bytes(w.psi, w.dp, stage, w.params_dtype,
                                              w.grads_dtype),
            "activations": activation_bytes(ws), "buffers": buffer_bytes(ws),
            "runtime_bytes": runtime, "peak_bytes": peak["total"],
            "peak_gib": round(peak["total"] / GIB, 3),
            "traffic_bytes_per_step": traffic_bytes(ws)}
        if budget is not None:
            record["fits"] = peak["total"] <= budget
        print(json.dumps(record))
    if budget is not None:
        best = choose_stage(w, budget, runtime)
        print(json.dumps({"recommended_zero_stage": best, "gpu_memory_gb": own["gpu_memory_gb"],
                          "rule": "least DP traffic per step among the stages whose "
                                  "predicted peak fits"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
