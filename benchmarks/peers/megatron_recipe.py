"""The Megatron recorder's run, as data: the tiny model's shape and its two families
(Llama's, GPT-2's), the optimizer's and schedule's settings, the global batches, and the
``args`` Namespace and sharded-save metadata Megatron-LM's ``save_checkpoint`` would store
for such a run (benchmarks/peers/record_megatron_checkpoint.py runs it)."""

from __future__ import annotations

import argparse

# (small: the fixtures are committed; query_groups: the Llama's)
SHAPE = dict(num_layers=2, hidden_size=16, heads=4, query_groups=2, ffn=32, vocab=64,
             seq_length=8, micro=2)
LR, MIN_LR, WD, CLIP, SEED, BETA2, EPS = 1e-3, 1e-4, 0.01, 1.0, 1234, 0.999, 1e-8
WARMUP, DECAY = 2, 40
SAVE_AT, CONTINUE = 3, 10
# the distributed optimizer's DDP bucket size (--ddp-bucket-size, with --overlap-grad-reduce):
# small, so the TP ranks' buffers split into several buckets, as a large model's do
BUCKET = 1000
# the model families: Llama's (the committed fixture), GPT-2's (the peer test's), and the
# Llama with every MLP a mixture of experts (Mixtral's shape: SequentialMLP experts of
# the dense ffn, a softmax router over the top k, the switch aux loss, dropless)
ARCH = {"llama": dict(normalization="RMSNorm", swiglu=True, position="rope", query_groups=2,
                      bias=False, tied=False),
        "gpt2": dict(normalization="LayerNorm", swiglu=False, position="learned_absolute",
                     query_groups=SHAPE["heads"], bias=True, tied=True),
        "mixtral": dict(normalization="RMSNorm", swiglu=True, position="rope", query_groups=2,
                        bias=False, tied=False, experts=4, topk=2, aux_loss=1e-2)}


def moe_record(arch: str) -> dict | None:
    """What losses.json records of ``arch``'s experts (None for a dense family)."""
    m = ARCH[arch]
    return {k: m[k] for k in ("experts", "topk", "aux_loss")} if m.get("experts") else None


def moe_config(arch: str) -> dict:
    """megatron-core's TransformerConfig fields of ``arch``'s experts (none for a dense
    family): the local spec's SequentialMLP, the alltoall dispatcher, no capacity.

    The recorder's ``--model mixtral``: the Llama with every MLP a mixture of experts (4
    SequentialMLP experts of the local spec, top 2 of a softmax router, the switch aux loss
    at 1e-2, the alltoall dispatcher, dropless), at ``--ep`` expert-parallel
    ranks (the experts split over the DP ranks). It trains through megatron-core's DDP (the
    experts' grads reduced over their own expert-data-parallel group) and
    ``get_megatron_optimizer``'s chained optimizers (one FP32Optimizer for the dense
    parameters, one for the experts', clipped by their joint norm): state keys
    ``chained_<i>.optimizer.state.exp_avg.<param>``, the experts'
    ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of shape (layers, experts, ...).
    Beyond the recorder's other CPU patches it needs benchmarks/peers/megatron_side.py's
    ``patch_megatron_moe_for_cpu`` (the alltoall dispatcher runs on gloo's all_to_all); no
    number changes, and megatron-core's own reload continues bit for bit."""
    m = ARCH[arch]
    if not m.get("experts"):
        return {}
    return dict(num_moe_experts=m["experts"], moe_router_topk=m["topk"],
                moe_ffn_hidden_size=SHAPE["ffn"], moe_aux_loss_coeff=m["aux_loss"],
                moe_router_load_balancing_type="aux_loss",
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)


def batches(n: int, gbs: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SHAPE["vocab"], (gbs, SHAPE["seq_length"] + 1), generator=g)
            for _ in range(n)]


def sharded_metadata(dist_opt: str | None) -> dict:
    """The ``metadata`` Megatron-LM's save_checkpoint hands the sharded state dicts: the
    distributed optimizer's sharding type (``dp_reshardable``, its default, or
    ``fully_reshardable`` under ``--dist-ckpt-optim-fully-reshardable``)."""
    meta: dict = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if dist_opt:
        meta["distrib_optim_sharding_type"] = dist_opt
    return meta


def megatron_args(tp: int, dp: int, iteration: int, arch: str, dist_opt: str | None = None,
                  bucket: int = 0, bf16: bool = False, *, gbs: int | None = None,
                  pp: int = 1, ep: int = 1, split: dict | None = None):
    """The Namespace Megatron-LM's ``save_checkpoint`` stores as ``args`` (the fields a
    reader of the checkpoint uses); ``bf16``: Megatron-LM's ``--bf16``, which turns on
    ``--accumulate-allreduce-grads-in-fp32``; ``gbs``: the global batch (by default one
    micro batch of ``SHAPE["micro"]`` rows per DP rank); ``split``: the fields of the
    run's split of the layers over the PP stages (``num_layers`` and the uneven stages',
    benchmarks/peers/megatron_pipeline.py's ``Split.args``)."""
    s, m = SHAPE, ARCH[arch]
    gbs = gbs or s["micro"] * dp
    ns = argparse.Namespace(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"],
        num_attention_heads=s["heads"], group_query_attention=m["query_groups"] != s["heads"],
        num_query_groups=m["query_groups"], kv_channels=s["hidden_size"] // s["heads"],
        ffn_hidden_size=s["ffn"], seq_length=s["seq_length"],
        max_position_embeddings=s["seq_length"], vocab_size=s["vocab"],
        padded_vocab_size=s["vocab"], make_vocab_size_divisible_by=s["vocab"] // tp,
        normalization=m["normalization"], norm_epsilon=1e-5, swiglu=m["swiglu"],
        position_embedding_type=m["position"], rotary_base=10000, rotary_percent=1.0,
        add_bias_linear=m["bias"], add_qkv_bias=False,
        untie_embeddings_and_output_weights=not m["tied"],
        qk_layernorm=False, num_experts=m.get("experts"), moe_router_topk=m.get("topk", 2),
        moe_ffn_hidden_size=s["ffn"] if m.get("experts") else None,
        moe_aux_loss_coeff=m.get("aux_loss", 0.0), moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        moe_expert_capacity_factor=None, moe_router_score_function="softmax",
        moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
        hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=1, expert_model_parallel_size=ep, data_parallel_size=dp,
        world_size=tp * pp * dp, micro_batch_size=gbs // dp, global_batch_size=gbs,
        optimizer="adam", lr=LR, min_lr=MIN_LR, lr_decay_style="cosine",
        lr_warmup_iters=WARMUP, lr_decay_iters=DECAY, lr_warmup_init=0.0,
        weight_decay=WD, start_weight_decay=WD, end_weight_decay=WD,
        weight_decay_incr_style="constant", adam_beta1=0.9, adam_beta2=BETA2,
        adam_eps=EPS, clip_grad=CLIP, seed=SEED, fp16=False, bf16=bf16,
        params_dtype="torch.bfloat16" if bf16 else "torch.float32",
        use_distributed_optimizer=bool(dist_opt),
        dist_ckpt_optim_fully_reshardable=dist_opt == "fully_reshardable",
        overlap_grad_reduce=bool(dist_opt and bucket),
        ddp_bucket_size=bucket if dist_opt and bucket else None,
        accumulate_allreduce_grads_in_fp32=bf16, transformer_impl="local",
        ckpt_format="torch_dist",
        iteration=iteration, consumed_train_samples=iteration * gbs,
        consumed_valid_samples=0, train_iters=SAVE_AT + CONTINUE, skipped_train_samples=0)
    vars(ns).update(split or {})
    return ns
