"""The transformer block of :mod:`models.gpt`: attention, MLP, norms, residuals.

GPT-2's block by default; the Llama-family options of the model section
(:class:`hybrid.config.model.ModelConfig`) swap
in RMSNorm, a SwiGLU MLP, rotary position embeddings, grouped-query attention
and bias-free linears (all but QKV with ``add_qkv_bias``, as Qwen2). Every option
keeps the TP split a split of whole heads (whole query groups) and of whole MLP
rows, so the block is the same function at every TP size.

Shapes: B batch, T sequence, C hidden, hs head size (``--kv-channels``, else C over
the heads); per TP rank nh query heads, ng query groups (key/value heads), f MLP width.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from hybrid.config.model import ModelConfig
from hybrid.kernels import bias_gelu, splits_bias
from hybrid.kernels.attention import attention_context
from hybrid.kernels.rotary import Rotary, split_qkv
from hybrid.kernels.swiglu import swiglu
from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel import (
    ColumnParallelLinear,
    LayerNorm,
    RMSNorm,
    RowParallelLinear,
    TPRNGTracker,
)
from hybrid.tensor_parallel.cp_attention import ContextParallel
from hybrid.tensor_parallel.token_split import TokenSplit
from hybrid.tensor_parallel.weight_grad import WeightGradStore
from models.moe import AuxLossScale, MoELayer


def make_norm(cfg: ModelConfig, tp_group: CommGroup, sequence_parallel: bool,
              width: int | None = None) -> nn.Module:
    """The block's and the final norm: ``cfg.normalization`` LayerNorm or RMSNorm over
    ``width`` channels (default the hidden size)."""
    norm = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return norm(width or cfg.hidden_size, tp_group, eps=cfg.norm_epsilon,
                sequence_parallel=sequence_parallel)


def norm_qk(qkv: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module, q_per_group: int,
            head_size: int) -> torch.Tensor:
    """``--qk-layernorm``: a fused QKV ``(B, T, ng * (nh / ng + 2) * hs)`` (the per-group
    layout of :class:`AttentionCore`) with each query head normalized by ``q_norm`` and
    each key head by ``k_norm`` over its ``hs`` channels; the value heads pass as they
    are. Same shape out."""
    B, T, _ = qkv.shape
    r = q_per_group
    x = qkv.view(B, T, -1, r + 2, head_size)  # (B, T, ng, r + 2, hs)
    q, k = q_norm(x[:, :, :, :r]), k_norm(x[:, :, :, r:r + 1])
    return torch.cat((q, k, x[:, :, :, r + 1:]), dim=3).view(B, T, -1)


class AttentionCore(nn.Module):
    """Causal scaled-dot-product attention over this rank's heads, with dropout.

    ``(B, T, ng * (nh / ng + 2) * hs)`` fused QKV in (per query group: its query
    heads, its key head, its value head), ``(B, T, nh * hs)`` out. RoPE, when on,
    is applied here to q and k. A module of its own (no parameters) so selective
    recompute can checkpoint exactly this: the split, rotation, scores, softmax
    and dropout, rerun in backward from the QKV output.

    With context parallelism (``cp``) T is this CP rank's share of the sequence:
    RoPE rotates by the tokens' global positions and attention reaches every
    rank's keys through ``cp`` (its dropout mask depends on positions and global
    heads only, ``head_offset`` being this TP rank's first head).
    """

    def __init__(self, cfg: ModelConfig, rng: TPRNGTracker | None,
                 cp: ContextParallel | None = None, head_offset: int = 0):
        super().__init__()
        self.head_size = cfg.head_size
        self.q_per_group = cfg.num_attention_heads // cfg.query_groups
        self.rotary = (Rotary(cfg.rotary_dim, cfg.rotary_base, cfg.rope_scaling_factor,
                              cfg.rotary_seq_len_interpolation_factor)
                       if cfg.position_embedding_type == "rope" else None)
        self.dropout = cfg.attention_dropout
        self.backend = cfg.attention_backend  # --attention-backend (hybrid/kernels/attention.py)
        self.rng = rng
        self.cp, self.head_offset = cp, head_offset

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        if self.q_per_group == 1 and self.rotary is None:  # q, k, v: views of qkv, no copy
            q, k, v = rearrange(qkv, "b t (nh three hs) -> three b nh t hs", three=3,
                                hs=self.head_size)  # each (B, nh, T, hs)
        else:  # q (B, nh, T, hs), k and v (B, ng, T, hs), fresh tensors in place of qkv
            pos = None if self.cp is None else self.cp.positions(qkv.shape[1], qkv.device)
            q, k, v = split_qkv(qkv, self.q_per_group, self.head_size, self.rotary, pos)
        p = self.dropout if self.training else 0.0
        if self.cp is not None:
            with attention_context(self.backend):
                y = self.cp.attention(q, k, v, p, self.head_offset)
            return rearrange(y, "b nh t hs -> b t (nh hs)")  # (B, T / C, nh * hs)
        # Heads differ per TP rank, so their dropout draws from the per-rank stream.
        fork = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with fork, attention_context(self.backend):
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                               enable_gqa=self.q_per_group > 1)
        return rearrange(y, "b nh t hs -> b t (nh hs)")  # (B, T, nh * hs)


class ParallelAttention(nn.Module):
    """Causal self-attention with query groups (and so heads) split over the TP group;
    with ``qk_layernorm`` its ``q_norm`` and ``k_norm`` (:func:`norm_qk`) normalize the
    query and key heads before the core rotates them."""

    def __init__(self, cfg: ModelConfig, tp_group: CommGroup, rng: TPRNGTracker | None,
                 sequence_parallel: bool, cp: ContextParallel | None = None,
                 weight_grads: WeightGradStore | None = None):
        super().__init__()
        C, tp = cfg.hidden_size, tp_group.size
        if cfg.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads {cfg.num_attention_heads} is not divisible "
                             f"by the tensor-parallel size {tp}")
        if cfg.query_groups % tp:
            raise ValueError(f"num_query_groups {cfg.query_groups} is not divisible by "
                             f"the tensor-parallel size {tp}")
        # QKV rows are laid out per query group as [its q heads | k | v], so a
        # contiguous chunk of rows is whole groups: the split is the same function
        # for every TP size (GPT-2, one head per group: [q k v] per head).
        # A QKV bias (add_qkv_bias) follows the same per-group row layout: a TP shard
        # of it is the bias of exactly the rank's groups.
        sp, bias = sequence_parallel, cfg.add_bias_linear
        self.qkv = ColumnParallelLinear(C, cfg.qkv_size, tp_group, bias=cfg.qkv_bias,
                                        sequence_parallel=sp, weight_grads=weight_grads)
        heads = cfg.num_attention_heads // tp
        if cp is not None:
            cp.check_heads(heads, cfg.query_groups // tp)
        # --qk-layernorm: one weight (hs,) for every query head, one for every key head.
        # Replicated over TP, but each TP rank normalizes other heads, so the gradients
        # differ per rank: built on the norms' sequence-parallel path (forward identity,
        # backward all-reduce over TP), which sums them and keeps the replicas equal,
        # with or without SP. Applied here, outside the core, so selective recompute
        # reruns the core from the normalized QKV and never the norms.
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_layernorm:
            self.q_norm = make_norm(cfg, tp_group, True, width=cfg.head_size)
            self.k_norm = make_norm(cfg, tp_group, True, width=cfg.head_size)
        self.q_per_group, self.head_size = cfg.num_attention_heads // cfg.query_groups, \
            cfg.head_size
        self.core = AttentionCore(cfg, rng, cp, head_offset=tp_group.rank * heads)
        # heads x hs -> C: the hidden size unless --kv-channels gives the heads their width
        self.proj = RowParallelLinear(cfg.attention_size, C, tp_group, bias=bias,
                                      input_is_parallel=True, sequence_parallel=sp,
                                      weight_grads=weight_grads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, ng * (nh / ng + 2) * hs); x is (B, T / tp, C) with SP
        if self.q_norm is not None and self.k_norm is not None:  # (--qk-layernorm: both)
            qkv = norm_qk(qkv, self.q_norm, self.k_norm, self.q_per_group, self.head_size)
        return self.proj(self.core(qkv))  # (B, T, C) summed over TP; (B, T / tp, C) with SP


class ParallelMLP(nn.Module):
    """C -> f (column-parallel) -> GELU -> C (row-parallel); with ``swiglu`` the
    up-projection is the fused ``[gate; up]`` pair (each f wide, split over TP
    per part) and ``silu(gate) * up`` the activation."""

    def __init__(self, cfg: ModelConfig, tp_group: CommGroup, sequence_parallel: bool,
                 weight_grads: WeightGradStore | None = None):
        super().__init__()
        sp, bias, parts = sequence_parallel, cfg.add_bias_linear, 2 if cfg.swiglu else 1
        self.swiglu = cfg.swiglu
        # [Note: which GELU] Megatron's default is the exact (erf) GELU; --openai-gelu
        # takes GPT-2's tanh approximation (Hugging Face's gelu_new), which aten's CPU
        # kernels compute about 2.8x slower, forward and backward.
        self.approximate = "tanh" if cfg.openai_gelu else "none"
        self.fc = ColumnParallelLinear(cfg.hidden_size, parts * cfg.ffn_size, tp_group,
                                       bias=bias, sequence_parallel=sp, parts=parts,
                                       weight_grads=weight_grads)
        self.proj = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, tp_group,
                                      bias=bias, sequence_parallel=sp, weight_grads=weight_grads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.proj(swiglu(self.fc(x)))  # (B, T, 2f) = [gate | up] -> (B, T, f)
        if self.fc.bias is not None and splits_bias(x):  # fused/compiled bias-GELU
            h, b = self.fc(x, skip_bias_add=True)
            return self.proj(bias_gelu(h, b, self.approximate))
        # eager (always on CPU): bias inside the matmul
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


def make_moe(cfg: ModelConfig, scale: AuxLossScale, ep_group: CommGroup | None = None,
             split: TokenSplit | None = None, etp_group: CommGroup | None = None,
             dp_group: CommGroup | None = None,
             weight_grads: WeightGradStore | None = None) -> MoELayer:
    """An MoE layer of ``cfg.moe`` in place of the block's MLP (:class:`models.moe.MoELayer`),
    its experts split over ``ep_group`` when given, each rank routing its own tokens of
    a micro-batch ``split`` over sequence parallelism's TP group and CP (None: the rank
    holds the whole micro-batch), each expert's hidden units split over ``etp_group``
    when given; ``dp_group``: where ``global_aux_loss`` sums its counts; ``weight_grads``:
    the model's store, to which a split backward defers the experts' and the shared
    expert's weight gradients. Under TP the
    tokens must be split, and the ETP x EP group folds over the TP ranks (Megatron's
    parallel folding)."""
    moe = cfg.moe
    assert moe is not None and moe.num_experts is not None
    return MoELayer(cfg.hidden_size, cfg.expert_ffn_size, moe.num_experts, moe.moe_router_topk,
                    swiglu=cfg.swiglu, scale=scale, balancing=moe.moe_router_load_balancing_type,
                    aux_coeff=moe.moe_aux_loss_coeff, z_coeff=moe.moe_z_loss_coeff,
                    shared_ffn=moe.moe_shared_expert_intermediate_size,
                    shared_gate=moe.moe_shared_expert_gate,
                    pre_softmax=moe.moe_router_pre_softmax,
                    score=moe.moe_router_score_function,
                    topk_scaling=moe.moe_router_topk_scaling_factor,
                    capacity_factor=moe.moe_expert_capacity_factor,
                    drop_policy=moe.moe_token_drop_policy,
                    init_method_std=cfg.init_method_std, ep_group=ep_group,
                    groups=moe.router_groups, split=split, etp_group=etp_group,
                    dp_group=dp_group, weight_grads=weight_grads)


def residual_rng(fork: bool, rng: TPRNGTracker | None):
    """The RNG context of residual-stream dropout. Replicated over TP, the default
    stream, identical on every TP rank, keeps the replicas equal; with SP or CP each
    rank holds other tokens, so the per-(TP, CP)-rank stream gives them independent
    masks (``fork``: SP or CP with dropout, decided when the model is built)."""
    if not fork:
        return contextlib.nullcontext()
    assert rng is not None, "dropout under SP or CP draws from the TP RNG tracker (rng=)"
    return rng.fork()


class Block(nn.Module):
    """Pre-norm transformer block. Input and output ``(B, T, C)``, replicated over TP
    (``(B, T / tp, C)``, this rank's tokens, with sequence parallelism); with context
    parallelism T is this CP rank's share of the sequence. ``weight_grads``: the model's
    store for its linears' deferred weight gradients (a split backward), or None.
    ``moe``: the model's :class:`models.moe.AuxLossScale` when this block's MLP is a
    mixture of experts (:func:`make_moe`), else None; ``ep_group``, ``etp_group``: its
    experts' EP and ETP groups; ``dp_group``: :func:`make_moe`'s."""

    def __init__(self, cfg: ModelConfig, tp_group: CommGroup, rng: TPRNGTracker | None,
                 sequence_parallel: bool, cp: ContextParallel | None = None,
                 weight_grads: WeightGradStore | None = None, moe: AuxLossScale | None = None,
                 ep_group: CommGroup | None = None, etp_group: CommGroup | None = None,
                 dp_group: CommGroup | None = None):
        super().__init__()
        self.rng = rng
        self.fork_residual_rng = (sequence_parallel or cp is not None) and cfg.hidden_dropout > 0
        self.ln_1 = make_norm(cfg, tp_group, sequence_parallel)
        self.attn = ParallelAttention(cfg, tp_group, rng, sequence_parallel, cp, weight_grads)
        self.ln_2 = make_norm(cfg, tp_group, sequence_parallel)
        if moe is not None and tp_group.size > 1 and not sequence_parallel:
            raise ValueError("an MoE layer under TP routes each rank's own tokens: build the "
                             "model with sequence_parallel (--sequence-parallel)")
        split = (TokenSplit(tp_group if sequence_parallel else None, cp)
                 if sequence_parallel or cp is not None else None)
        self.mlp: nn.Module = (ParallelMLP(cfg, tp_group, sequence_parallel, weight_grads)
                               if moe is None else make_moe(cfg, moe, ep_group, split,
                                                            etp_group, dp_group, weight_grads))
        self.drop = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.ln_1(x))
        with residual_rng(self.fork_residual_rng, self.rng):
            x = x + self.drop(a)
        m = self.mlp(self.ln_2(x))
        with residual_rng(self.fork_residual_rng, self.rng):
            return x + self.drop(m)
