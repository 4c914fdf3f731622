#!/usr/bin/env python
"""One MoE layer's forward and backward at a fixed shape: hybrid's, megatron-core's, and a
dense MLP of the same active parameters, in one process.

    python -m benchmarks.bench_moe [--tokens 2048] [--rounds 7]

The shape: T tokens of hidden 256, 8 SwiGLU experts of width 512, each token to 2 of
them (Mixtral's routing: a softmax over the top 2 logits). hybrid's is
:class:`models.moe.MoE` (its experts' matmuls a loop in expert order); megatron-core
0.16.1's is its ``MoELayer`` from ``get_gpt_layer_local_spec(num_experts=8)`` (the
alltoall dispatcher, its sequential experts, no aux loss), on the CPU with
../shared/BENCHMARKS.md's patches, at EP 1 in a gloo group of one; the dense MLP is one
SwiGLU MLP of width 2 x 512 (the parameters a token goes through), as hybrid's shared
expert computes it. A round times each of the three once (forward, ``y.square().mean()``,
backward), in ABBA order over the rounds; the record is the median seconds and tokens/s
of each, and the ratios. The expert exchange's bytes at EP > 1 are the scale bench's
(``benchmarks.bench_moe_scale``, against the estimator's formula). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from benchmarks.fake_rank import machine
from benchmarks.peers.megatron_side import (
    megatron_missing,
    patch_megatron_for_cpu,
    patch_megatron_moe_for_cpu,
)
from benchmarks.timing import emit, median_of
from models.moe import MoE, SharedExpert

HIDDEN, FFN, EXPERTS, TOPK = 256, 512, 8, 2


def _megatron_layer():
    """megatron-core's MoE layer of the shape, on the CPU (module doc)."""
    import torch.distributed as dist
    patch_megatron_for_cpu()
    patch_megatron_moe_for_cpu()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    return build_module(spec.submodules.mlp, config=config)


def _timed(step) -> float:
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(a.tokens, HIDDEN)
    hybrid = MoE(HIDDEN, FFN, EXPERTS, TOPK, swiglu=True)
    torch.nn.init.normal_(hybrid.router.weight, std=0.02)
    dense = SharedExpert(HIDDEN, TOPK * FFN, swiglu=True)

    def fwd_bwd(run):
        def step():
            inp = x.clone().requires_grad_()
            run(inp).square().mean().backward()
        return step

    steps = {"hybrid_moe": fwd_bwd(lambda t: hybrid(t)[0]),
             "dense_mlp": fwd_bwd(dense)}
    missing = megatron_missing()
    if missing is None:
        megatron = _megatron_layer()
        # (its input is sequence-first: (S, B, H), a batch of one here)
        steps["megatron_moe"] = fwd_bwd(lambda t: megatron(t.unsqueeze(1))[0])
    names = list(steps)
    for name in names:  # warm-up: allocations, lazy initializations
        steps[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(_timed(steps[name]))
    med = {n: median_of(t) for n, t in times.items()}
    record = {"bench": "moe_layer", "machine": {**machine(), "threads":
                                                 torch.get_num_threads()},
              "shape": {"tokens": a.tokens, "hidden": HIDDEN, "ffn": FFN,
                        "experts": EXPERTS, "topk": TOPK, "swiglu": True},
              "rounds": a.rounds, "seconds": med,
              "tokens_per_s": {n: round(a.tokens / s) for n, s in med.items()},
              "hybrid_over_dense": round(med["hybrid_moe"] / med["dense_mlp"], 3)}
    if "megatron_moe" in med:
        record["hybrid_over_megatron"] = round(med["hybrid_moe"] / med["megatron_moe"], 3)
    else:
        record["megatron_moe"] = f"not run: {missing}"
    emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
