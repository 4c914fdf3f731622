#!/usr/bin/env python
"""Per-rank model-state memory (params, grads, optimizer) for a GPT under TP x ZeRO.

    python scripts/estimate_memory.py --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 2048 --vocab-size 50257 \
        --tensor-model-parallel-size 2 --data-parallel-size 64 --bf16

Prints one JSON record per ZeRO stage (or just --zero-stage), from the ZeRO
paper's formulas with Psi = the parameters of one TP rank. Activations,
communication buffers and framework overhead come on top.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.config import padded_vocab_size  # noqa: E402
from hybrid.zero.estimate import model_state_bytes  # noqa: E402
from models.gpt import GPTConfig  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-layers", type=int, required=True)
    ap.add_argument("--hidden-size", type=int, required=True)
    ap.add_argument("--num-attention-heads", type=int, required=True)
    ap.add_argument("--ffn-hidden-size", type=int, default=None)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--max-position-embeddings", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    ap.add_argument("--tensor-model-parallel-size", type=int, default=1)
    ap.add_argument("--data-parallel-size", type=int, default=1)
    ap.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None)
    prec = ap.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true")
    prec.add_argument("--fp16", action="store_true")
    a = ap.parse_args(argv)
    tp = a.tensor_model_parallel_size
    if a.num_attention_heads % tp or a.hidden_size % a.num_attention_heads:
        ap.error("--num-attention-heads must divide --hidden-size and be divisible by "
                 "--tensor-model-parallel-size")
    cfg = GPTConfig(vocab_size=a.vocab_size,
                    padded_vocab_size=padded_vocab_size(a.vocab_size,
                                                        a.make_vocab_size_divisible_by, tp),
                    num_layers=a.num_layers, hidden_size=a.hidden_size,
                    num_attention_heads=a.num_attention_heads,
                    max_position_embeddings=a.max_position_embeddings or a.seq_length,
                    ffn_hidden_size=a.ffn_hidden_size)
    psi = cfg.num_parameters(tp)
    dtype = "bf16" if a.bf16 else "fp16" if a.fp16 else "fp32"
    stages = [a.zero_stage] if a.zero_stage is not None else [0, 1, 2, 3]
    for stage in stages:
        b = model_state_bytes(psi, a.data_parallel_size, stage, dtype)
        print(json.dumps({"zero_stage": stage, "dtype": dtype, "tp": tp,
                          "dp": a.data_parallel_size, "params_total": cfg.num_parameters(),
                          "params_per_tp_rank": psi, **{f"{k}_bytes": v for k, v in b.items()},
                          "total_gib": round(b["total"] / 2**30, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
