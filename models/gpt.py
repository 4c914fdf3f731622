"""GPT-2, built from tensor-parallel layers.

The architecture is GPT-2's: learned position embeddings, pre-LayerNorm blocks,
GELU MLP with 4x expansion, biases everywhere, and an output head tied to the
token embedding. The model knows nothing of data parallelism, ZeRO or
activation checkpointing; those are applied from outside (``model.blocks`` is
the list they wrap).

Tensor parallelism, with ``tp`` ranks in the TP group:

* token embedding: vocabulary rows split over TP (VocabParallelEmbedding);
* attention: each rank owns ``num_heads / tp`` heads -- QKV is a column-parallel
  linear, the output projection a row-parallel one;
* MLP: column-parallel up-projection, row-parallel down-projection;
* head: logits for this rank's vocabulary slice only, fed straight into the
  vocab-parallel cross-entropy, so full logits never exist on one rank.

With ``sequence_parallel`` (TP > 1) the residual stream between the TP regions
-- embeddings, LayerNorms, dropout, residual adds -- holds this rank's chunk of
the sequence, ``(B, T / tp, C)``: the embedding reduce-scatters, every
column-parallel layer all-gathers its input, every row-parallel layer
reduce-scatters its output, and the final LayerNorm's output is gathered before
the head. Each rank now holds different tokens there, so that dropout draws
from the per-TP-rank stream, and the replicated parameters used there get
their gradients summed over TP (see :mod:`hybrid.tensor_parallel.layers`).

Shapes: B batch, T sequence, C hidden, nh heads on this rank, hs head size,
V padded vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from hybrid.comm import CommGroup
from hybrid.kernels import bias_gelu, linear, splits_bias
from hybrid.tensor_parallel import (ColumnParallelLinear, Init, LayerNorm, RowParallelLinear,
                                    TPRNGTracker, VocabParallelEmbedding, copy_to_tp,
                                    init_parameters, sequence_gathered_linear,
                                    sequence_parallel_param, vocab_parallel_cross_entropy)


@dataclass
class GPTConfig:
    vocab_size: int  # ids that can occur in the data
    padded_vocab_size: int  # embedding rows; >= vocab_size, divisible by TP
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    max_position_embeddings: int
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    sequence_parallel: bool = False  # split norms/dropout/residuals along T over TP

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self, tp: int = 1) -> int:
        """Parameters held by one TP rank of ``tp`` (the whole model for tp=1).

        Split over TP: token embedding, QKV and MLP-up weights and biases, both
        projection weights. Replicated: positions, LayerNorms, projection biases.
        """
        C, F_, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        split = self.padded_vocab_size * C + L * (3 * C * C + 3 * C + C * C + C * F_ + F_ + F_ * C)
        replicated = self.max_position_embeddings * C + L * (4 * C + 2 * C) + 2 * C
        return split // tp + replicated

    def flops_per_token(self, seq_length: int) -> float:
        """Forward+backward FLOPs per token (dense matmuls and attention scores)."""
        C, F_, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        matmul = 2 * (3 * C * C + C * C + 2 * C * F_) * L + 2 * C * self.padded_vocab_size
        attention = 2 * 2 * seq_length * C * L  # QK^T and AV
        return 3 * (matmul + attention)


class AttentionCore(nn.Module):
    """Causal scaled-dot-product attention over this rank's heads, with dropout.

    ``(B, T, 3 * nh * hs)`` QKV in, ``(B, T, nh * hs)`` out. A module of its own
    (no parameters) so selective recompute can checkpoint exactly this: the
    scores, softmax and dropout, rerun in backward from the QKV output.
    """

    def __init__(self, cfg: GPTConfig, rng: TPRNGTracker | None):
        super().__init__()
        self.head_size = cfg.head_size
        self.dropout = cfg.attention_dropout
        self.rng = rng

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(qkv, "b t (nh three hs) -> three b nh t hs", three=3,
                            hs=self.head_size)  # each (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        # Heads differ per TP rank, so their dropout draws from the per-rank stream.
        fork = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with fork:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return rearrange(y, "b nh t hs -> b t (nh hs)")  # (B, T, nh * hs)


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over the TP group."""

    def __init__(self, cfg: GPTConfig, tp_group: CommGroup, rng: TPRNGTracker | None):
        super().__init__()
        C, tp = cfg.hidden_size, tp_group.size
        if cfg.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads {cfg.num_attention_heads} is not divisible "
                             f"by the tensor-parallel size {tp}")
        # QKV rows are laid out per head as [q | k | v], so a contiguous chunk of
        # rows is whole heads: the split is the same function for every TP size.
        sp = cfg.sequence_parallel
        self.qkv = ColumnParallelLinear(C, 3 * C, tp_group, sequence_parallel=sp)
        self.core = AttentionCore(cfg, rng)
        self.proj = RowParallelLinear(C, C, tp_group, input_is_parallel=True,
                                      sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3 * nh * hs); x is (B, T / tp, C) with SP
        return self.proj(self.core(qkv))  # (B, T, C) summed over TP; (B, T / tp, C) with SP


class ParallelMLP(nn.Module):
    """C -> ffn (column-parallel) -> GELU -> C (row-parallel)."""

    def __init__(self, cfg: GPTConfig, tp_group: CommGroup):
        super().__init__()
        sp = cfg.sequence_parallel
        self.fc = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp_group,
                                       sequence_parallel=sp)
        self.proj = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, tp_group,
                                      sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if splits_bias(x):  # fused/compiled bias-GELU: the bias add moves into it
            h, b = self.fc(x, skip_bias_add=True)
            return self.proj(bias_gelu(h, b))
        # eager (always on CPU): bias inside the matmul, exactly as before
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def _residual_rng(cfg: GPTConfig, rng: TPRNGTracker | None):
    """The RNG context of residual-stream dropout. Replicated over TP, the default
    stream, identical on every TP rank, keeps the replicas equal; with SP each rank
    holds other tokens, so the per-TP-rank stream gives them independent masks."""
    if cfg.sequence_parallel and cfg.hidden_dropout > 0:
        return rng.fork()
    return contextlib.nullcontext()


class Block(nn.Module):
    """Pre-LN transformer block. Input and output ``(B, T, C)``, replicated over TP
    (``(B, T / tp, C)``, this rank's tokens, with sequence parallelism)."""

    def __init__(self, cfg: GPTConfig, tp_group: CommGroup, rng: TPRNGTracker | None):
        super().__init__()
        self.cfg, self.rng = cfg, rng
        sp, eps = cfg.sequence_parallel, cfg.layernorm_epsilon
        self.ln_1 = LayerNorm(cfg.hidden_size, tp_group, eps=eps, sequence_parallel=sp)
        self.attn = ParallelAttention(cfg, tp_group, rng)
        self.ln_2 = LayerNorm(cfg.hidden_size, tp_group, eps=eps, sequence_parallel=sp)
        self.mlp = ParallelMLP(cfg, tp_group)
        self.drop = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.ln_1(x))
        with _residual_rng(self.cfg, self.rng):
            x = x + self.drop(a)
        m = self.mlp(self.ln_2(x))
        with _residual_rng(self.cfg, self.rng):
            return x + self.drop(m)


class GPT(nn.Module):
    """GPT-2 language model over the TP group of ``tp_group``.

    ``forward(tokens)`` returns this rank's logits ``(B, T, V / tp)``;
    ``forward(tokens, labels)`` returns the mean token loss (a scalar, equal on
    every TP rank).
    """

    def __init__(self, cfg: GPTConfig, tp_group: CommGroup, rng: TPRNGTracker | None = None,
                 seed: int = 1234, device: torch.device | str = "cpu"):
        """Build on ``device`` and draw the init from ``seed`` -- or, with
        ``device="meta"``, only shapes: ZeRO then materializes what each rank keeps
        (``apply_zero(..., values=InitValues(seed, model.init_of))``)."""
        super().__init__()
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not divisible by "
                             f"num_attention_heads {cfg.num_attention_heads}")
        if tp_group.size > 1 and cfg.attention_dropout > 0 and rng is None:
            raise ValueError("attention dropout under TP needs the TP RNG tracker (rng=...)")
        if cfg.sequence_parallel and tp_group.size == 1:
            raise ValueError("sequence parallelism needs a TP group of 2 or more ranks")
        if cfg.sequence_parallel and cfg.hidden_dropout > 0 and rng is None:
            raise ValueError("dropout under sequence parallelism needs the TP RNG tracker "
                             "(rng=...)")
        self.cfg = cfg
        self.tp_group = tp_group
        with torch.device(device):
            self.wte = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, tp_group,
                                              sequence_parallel=cfg.sequence_parallel)
            self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            self.drop = nn.Dropout(cfg.hidden_dropout)
            self.blocks = nn.ModuleList(Block(cfg, tp_group, rng) for _ in range(cfg.num_layers))
            self.ln_f = LayerNorm(cfg.hidden_size, tp_group, eps=cfg.layernorm_epsilon,
                                  sequence_parallel=cfg.sequence_parallel)
        self.rng = rng
        # Padded vocabulary columns on this rank (ids >= vocab_size) are masked
        # out of the softmax, so padding never changes the loss: the model is the
        # same function for any TP size even though the padding depends on it.
        self._valid_local = max(0, min(cfg.vocab_size - self.wte.vocab_start,
                                       self.wte.vocab_end - self.wte.vocab_start))
        if torch.device(device).type != "meta":
            init_parameters(self, seed, self.init_of)

    def init_of(self, name: str) -> Init:
        """How parameter ``name``'s full value is drawn (GPT-2's init)."""
        cfg = self.cfg
        if name.endswith("bias"):
            return Init("zeros")
        if ".ln_" in name or name.startswith("ln_f"):
            return Init("ones")
        if name.endswith("proj.weight"):  # residual projections: scaled by depth (GPT-2)
            return Init("normal", cfg.init_std / math.sqrt(2 * cfg.num_layers))
        if name == "wte.weight":  # padding rows stay zero
            return Init("normal", cfg.init_std, valid_rows=cfg.vocab_size)
        return Init("normal", cfg.init_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        B, T = tokens.shape
        if T > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        pos = torch.arange(T, device=tokens.device)
        sp, g = self.cfg.sequence_parallel, self.tp_group
        if sp:  # this rank's positions, and wpe's gradient summed over TP
            pos = pos.chunk(g.size)[g.rank]
            wpe = F.embedding(pos, sequence_parallel_param(self.wpe.weight, g))
        else:
            wpe = self.wpe(pos)
        with _residual_rng(self.cfg, self.rng):
            x = self.drop(self.wte(tokens) + wpe)  # (B, T, C); (B, T / tp, C) with SP
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if sp:  # gather the sequence for the head, keeping only the local x for backward
            logits = sequence_gathered_linear(x, self.wte.weight, None, g)  # (B, T, V / tp)
        else:
            logits = linear(copy_to_tp(x, g), self.wte.weight)  # (B, T, V / tp)
        # The cross-entropy takes the valid width instead of reading a masked copy
        # (one pass over the logits less); returned logits get the -inf mask.
        if labels is None and self._valid_local < logits.shape[-1]:
            pad = torch.arange(logits.shape[-1], device=logits.device) >= self._valid_local
            logits = logits.masked_fill(pad, float("-inf"))
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group,
                                            valid=self._valid_local).mean()
