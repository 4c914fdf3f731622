"""The model section: a GPT's shape, written down once.

:class:`ModelConfig` is what :func:`hybrid.config.build_config` cuts from the
flags (:meth:`ModelConfig.from_flags`), what :class:`models.gpt.GPT` is built
from, what the memory estimator (:mod:`hybrid.estimate.memory`) counts, and
what a checkpoint is rebuilt from: its ``metadata.json`` keeps the flat flags
(``"config"``) and the vocabulary (``"vocab_size"``), and ``from_flags`` reads
that dict the way it reads the command line (a key an older checkpoint lacks
takes its default).

The vocabulary is the tokenizer's, and the config loads no tokenizer: the
section holds ``vocab_size=None`` until :meth:`ModelConfig.with_vocab_size`
gives the copy with the tokenizer's size. The embedding's rows are that
vocabulary padded for the TP size, :meth:`ModelConfig.padded_vocab_size`,
the one place that rounding is done. Parameters and FLOPs are counted here
too (:meth:`ModelConfig.num_parameters`, :meth:`ModelConfig.flops_per_token`),
once, for the training log, the estimator and the benchmarks.

Not here: ``sequence_parallel`` is how the parallel section runs the model,
not the model (``GPT(..., sequence_parallel=...)`` takes it from
:class:`hybrid.config.sections.ParallelConfig`). ``attention_backend`` is
here, as in Megatron's TransformerConfig: every attention core reads it once,
when the model is built; it picks torch's kernel, not the function.

No torch import: the launcher checks a command line with this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace

from hybrid.config.architecture import architecture_fields, swiglu_ffn_hidden_size
from hybrid.config.moe import MoEConfig
from hybrid.config.options import flag_of, opt


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-2 or Llama-family model (Megatron's flags of the same names).

    ``ffn_hidden_size`` None is filled at construction: 4 x hidden, or with
    ``swiglu`` Megatron's 8h/3 rounded down to a multiple of 64.
    ``seq_length``: the tokens of a training sample (what the estimator and the
    FLOP count take); ``max_position_embeddings`` bounds it.
    ``vocab_size``: ids that can occur in the data (the tokenizer's), None until
    known; the embedding holds :meth:`padded_vocab_size` rows.
    """

    num_layers: int = opt(4, "transformer layers", at_least=1)
    hidden_size: int = opt(256, "model width", at_least=1)
    num_attention_heads: int = opt(4, "attention heads (divisible by TP)", at_least=1)
    ffn_hidden_size: int | None = None
    seq_length: int = opt(128, "tokens per sample", at_least=1)
    max_position_embeddings: int = 128
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = opt(128, "pad vocab to a multiple of this x TP", at_least=1)
    hidden_dropout: float = opt(0.1, "dropout on the residual stream", at_least=0, below=1)
    attention_dropout: float = opt(0.1, "dropout on attention probabilities", at_least=0, below=1)
    init_method_std: float = opt(0.02, "std of the normal weight init", at_least=0)
    attention_backend: str = opt(
        "auto", "auto, flash, fused, unfused or local: which attention kernel runs (auto: torch's "
        "SDPA picks)", choices=("auto", "flash", "fused", "unfused", "local"))
    # the Llama family (hybrid.config.architecture; defaults: GPT-2)
    normalization: str = "LayerNorm"  # or RMSNorm
    norm_epsilon: float = 1e-5
    swiglu: bool = False  # gated SiLU MLP
    openai_gelu: bool = False  # the MLP's GELU: tanh approximation (GPT-2's); False: exact
    position_embedding_type: str = "learned_absolute"  # rope, none
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # RoPE on this fraction of each head's channels
    rope_scaling_factor: float | None = None  # Llama-3.1 scaling (--use-rope-scaling); None: off
    rotary_seq_len_interpolation_factor: float | None = None  # positions / this; None: off
    num_query_groups: int | None = None  # key/value heads; None: one per query head
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # QKV keeps a bias when add_bias_linear is off (Qwen2)
    kv_channels: int | None = None  # each head's width; None: hidden_size / heads
    qk_layernorm: bool = False  # q and k heads normalized (over their width) before RoPE
    compile: bool = opt(
        False, "torch.compile each transformer block's forward (same results to rounding; its "
        "speed was not measured)")
    moe: MoEConfig | None = None  # the MoE layers (hybrid.config.moe); None: dense

    def __post_init__(self):
        if self.ffn_hidden_size is None:  # frozen: the one write, before anyone reads it
            object.__setattr__(self, "ffn_hidden_size",
                               swiglu_ffn_hidden_size(self.hidden_size) if self.swiglu
                               else 4 * self.hidden_size)

    @classmethod
    def from_flags(cls, f) -> ModelConfig:
        """The section of checked :class:`hybrid.config.flags.Flags`, or of the flat
        flags dict a checkpoint's metadata.json saves (``"config"``; a missing key
        takes the default: 128 for ``make_vocab_size_divisible_by``, GPT-2's
        architecture). The vocabulary is not a flag: see :meth:`with_vocab_size`."""
        def get(name, default):
            value = f.get(name) if isinstance(f, dict) else getattr(f, name)
            return default if value is None else value
        defaults = cls()
        # the fields that declare their flag are copied as they are, each with the
        # section's default for a saved config that lacks it (older than the flag)
        plain = {f.name: get(flag, getattr(defaults, f.name)) for f in fields(cls)
                 if (flag := flag_of(f)) is not None}
        # checked flags always carry it; a saved dict without it: positions = sequence
        positions = get("max_position_embeddings", plain["seq_length"])
        return cls(ffn_hidden_size=get("ffn_hidden_size", None),  # None: filled per swiglu
                   max_position_embeddings=positions, **plain, **architecture_fields(f),
                   moe=MoEConfig.from_flags(f))

    def with_vocab_size(self, vocab_size: int) -> ModelConfig:
        """This model with the tokenizer's vocabulary of ``vocab_size`` ids."""
        return replace(self, vocab_size=vocab_size)

    def padded_vocab_size(self, tp: int) -> int:
        """Rows of the token embedding (and of an untied output layer) at TP size ``tp``:
        the vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tp``
        (Megatron's rule), so every TP rank holds the same number of rows. The padding
        rows are zero and masked out of the softmax: the function is the same at any
        ``tp``."""
        if self.vocab_size is None:
            raise ValueError("the vocabulary is not known yet: take "
                             "ModelConfig.with_vocab_size(tokenizer.vocab_size)")
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def head_size(self) -> int:
        """Each attention head's width: ``kv_channels``, else hidden / heads (which then
        divides exactly: the config checks it)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_size(self) -> int:
        """Width of the attention output, the output projection's input: every query
        head's ``head_size`` (the hidden size unless ``kv_channels`` says otherwise)."""
        return self.num_attention_heads * self.head_size

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per query head (no GQA)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV weight: every query head, and a key and a value per group."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_size

    @property
    def qkv_bias(self) -> bool:
        """The fused QKV projection has a bias (Megatron: add_bias_linear or add_qkv_bias)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def ffn_size(self) -> int:
        """``ffn_hidden_size``, which construction fills when it is given as None."""
        assert self.ffn_hidden_size is not None  # __post_init__ filled it
        return self.ffn_hidden_size

    @property
    def mlp_up_size(self) -> int:
        """Rows of the MLP's up-projection: ``ffn_hidden_size``, twice that with SwiGLU
        (gate and up fused)."""
        return (2 if self.swiglu else 1) * self.ffn_size

    @property
    def rotary_dim(self) -> int:
        """Channels of each head RoPE rotates."""
        return int(self.head_size * self.rotary_percent)

    # [Note: parameter counts] Each count is (split over TP) // tp + replicated. Split:
    # the token embedding and an untied output layer (vocabulary rows), QKV and the MLP's
    # up-projection (weights and biases), both projections' weights. Replicated: learned
    # positions, norms (the query and key norms too), the projections' biases. For a model
    # GPT builds every split dimension is a multiple of tp (whole heads, whole query
    # groups, the padded vocabulary), so the division is exact and the per-block and
    # whole-model counts agree.

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (global index) is an MoE layer ([Note: which layers are MoE]
        in :mod:`hybrid.config.moe`)."""
        return self.moe is not None and self.moe.layers(self.num_layers)[i]

    @property
    def expert_ffn_size(self) -> int:
        """Each expert's MLP width: ``--moe-ffn-hidden-size``, else ``ffn_hidden_size``."""
        assert self.moe is not None
        return self.moe.moe_ffn_hidden_size or self.ffn_size

    def _mlp_counts(self, moe: bool) -> tuple[int, int, float]:
        """(split over TP, replicated, forward matmul FLOPs per token) of one block's MLP:
        the dense MLP, or an MoE layer's router, experts (no biases) and shared expert,
        its FLOPs those of the top-k experts a token goes to (all replicated over TP)."""
        C, parts = self.hidden_size, 2 if self.swiglu else 1
        if not moe:
            F, bias = self.ffn_size, int(self.add_bias_linear)
            return (self.mlp_up_size * (C + bias) + F * C, bias * C,
                    2 * (self.mlp_up_size * C + F * C))
        assert self.moe is not None
        E, k, Fe = self.moe.num_experts or 0, self.moe.moe_router_topk, self.expert_ffn_size
        expert = (parts + 1) * Fe * C
        shared = (parts + 1) * (self.moe.moe_shared_expert_intermediate_size or 0) * C
        shared += C if self.moe.moe_shared_expert_gate else 0  # (its gate's weight vector)
        # whole on every TP rank (the experts at ETP 1, the router and shared expert
        # running each rank's own tokens under sequence parallelism)
        return 0, E * expert + E * C + shared, 2 * (k * expert + E * C + shared)

    def _block_counts(self, moe: bool = False) -> tuple[int, int]:
        """(split over TP, replicated) parameters of one transformer block (an MoE one:
        ``moe``; its experts counted whole, as at TP 1)."""
        C = self.hidden_size
        bias, qkv_bias = int(self.add_bias_linear), int(self.qkv_bias)
        mlp_split, mlp_replicated, _ = self._mlp_counts(moe)
        split = self.qkv_size * (C + qkv_bias) + self.attention_size * C + mlp_split
        return split, 2 * self._norm_parameters + self._qk_norm_parameters + bias * C \
            + mlp_replicated

    def _root_counts(self, tp: int) -> tuple[int, int]:
        """(split over TP, replicated) parameters outside the blocks, padded for ``tp``."""
        C = self.hidden_size
        heads = 2 if self.untie_embeddings_and_output_weights else 1
        positions = (self.max_position_embeddings * C
                     if self.position_embedding_type == "learned_absolute" else 0)
        return heads * self.padded_vocab_size(tp) * C, positions + self._norm_parameters

    @property
    def _norm_parameters(self) -> int:
        return (2 if self.normalization == "LayerNorm" else 1) * self.hidden_size

    @property
    def _qk_norm_parameters(self) -> int:
        """One block's query and key norms (``qk_layernorm``), each ``head_size`` wide."""
        per_norm = (2 if self.normalization == "LayerNorm" else 1) * self.head_size
        return 2 * per_norm if self.qk_layernorm else 0

    def block_parameters(self, tp: int = 1, moe: bool | None = None) -> int:
        """Parameters of one transformer block on one TP rank of ``tp`` (see the note):
        a dense block, an MoE one (``moe``), or by default the largest the model has."""
        moe = self.moe is not None and any(self.moe.layers(self.num_layers)) \
            if moe is None else moe
        split, replicated = self._block_counts(moe)
        return split // tp + replicated

    def _layers_parameters(self, tp: int, layers: Iterable[int]) -> int:
        return sum(self.block_parameters(tp, self.is_moe_layer(i)) for i in layers)

    @staticmethod
    def _ids(layers: int | Sequence[int], start: int) -> Sequence[int]:
        """The layers a count from ``start``, or the global ids themselves, stand for."""
        return range(start, start + layers) if isinstance(layers, int) else layers

    def expert_parameters(self, layers: Iterable[int]) -> int:
        """The routed experts' parameters (every expert, at TP 1) of ``layers``: what
        expert parallelism splits; the router and a shared expert stay whole."""
        if self.moe is None:
            return 0
        parts = 2 if self.swiglu else 1
        per_layer = (self.moe.num_experts or 0) * (parts + 1) * self.expert_ffn_size \
            * self.hidden_size
        return per_layer * sum(self.is_moe_layer(i) for i in layers)

    def root_parameters(self, tp: int = 1) -> int:
        """Parameters outside the blocks on one TP rank of ``tp``: embeddings, final norm,
        untied output layer (the vocabulary padded for ``tp``)."""
        split, replicated = self._root_counts(tp)
        return split // tp + replicated

    def stage_parameters(self, tp: int, layers: int | Sequence[int], first: bool, last: bool,
                         start: int = 0) -> int:
        """Parameters one TP rank of a pipeline stage holds: its ``layers`` blocks (a count
        from layer ``start``, or their global ids: an MoE model's layers differ), the
        embeddings on the ``first`` stage, the final norm and the
        output layer on the ``last`` one. With tied embeddings and more than one stage the
        last stage keeps its own copy of the word embedding as the output layer
        (Megatron's; the two are kept equal over the embedding group). One stage that is
        both: the whole model, :meth:`num_parameters`."""
        C = self.hidden_size
        rows = self.padded_vocab_size(tp) * C  # one vocabulary-wide matrix
        positions = (self.max_position_embeddings * C
                     if self.position_embedding_type == "learned_absolute" else 0)
        head = last and (self.untie_embeddings_and_output_weights or not first)
        split = rows * first + rows * head
        replicated = positions * first + self._norm_parameters * last
        return (self._layers_parameters(tp, self._ids(layers, start)) + split // tp
                + replicated)

    def num_parameters(self, tp: int = 1, *, per_rank: bool = True) -> int:
        """Parameters of this model run at TP size ``tp`` (the vocabulary padded for
        ``tp``): Psi, what one TP rank holds; with ``per_rank=False`` the whole model,
        every split parameter counted once."""
        if per_rank:
            return self._layers_parameters(tp, range(self.num_layers)) + self.root_parameters(tp)
        blocks = sum(sum(self._block_counts(self.is_moe_layer(i)))
                     for i in range(self.num_layers))
        return blocks + sum(self._root_counts(tp))

    def flops_per_token(self, tp: int = 1) -> float:
        """Forward+backward FLOPs per token of a ``seq_length`` sample at TP size ``tp``
        (the head over the vocabulary padded for ``tp``): dense matmuls and attention
        scores, summed over the TP ranks; an MoE layer's MLP counts the top-k experts a
        token goes to, its router and its shared expert."""
        return self.stage_flops_per_token(tp, self.num_layers, last=True)

    def stage_flops_per_token(self, tp: int, layers: int | Sequence[int], last: bool,
                              start: int = 0) -> float:
        """:meth:`flops_per_token` of one pipeline stage: its ``layers`` blocks (a count from
        layer ``start``, or their global ids), and the output layer on the ``last`` stage.
        The embedding is a lookup, no FLOPs, so the first stage counts its blocks only; the
        stages' sum is the whole model's."""
        C = self.hidden_size
        ids = self._ids(layers, start)
        n = len(ids)
        mlp = sum(self._mlp_counts(self.is_moe_layer(i))[2] for i in ids)
        matmul = 2 * (self.qkv_size * C + self.attention_size * C) * n + mlp \
            + 2 * C * self.padded_vocab_size(tp) * last
        # QK^T and AV, over every head's width (the hidden size unless kv_channels)
        attention = 2 * 2 * self.seq_length * self.attention_size * n
        return 3 * (matmul + attention)
