"""GPT-2 and the Llama family, built from tensor-parallel layers.

By default the architecture is GPT-2's: learned position embeddings,
pre-LayerNorm blocks, GELU MLP with 4x expansion, biases everywhere, and an
output head tied to the token embedding. The model is built from its section,
:class:`hybrid.config.model.ModelConfig`, whose fields are the Megatron flags of
the same names; a few make it a Llama: ``normalization="RMSNorm"``, ``swiglu``,
``position_embedding_type="rope"``, ``num_query_groups`` (GQA),
``untie_embeddings_and_output_weights`` and ``add_bias_linear=False`` (Qwen2:
with ``add_qkv_bias``, a bias on the QKV projection only); Qwen3 adds
``kv_channels`` (heads of their own width) and ``qk_layernorm``. The
model knows nothing of data parallelism, ZeRO or activation checkpointing;
those are applied from outside (``model.blocks`` is the list they wrap). The
block itself is in :mod:`models.blocks`.

Tensor parallelism, with ``tp`` ranks in the TP group:

* token embedding: vocabulary rows split over TP (VocabParallelEmbedding);
* attention: each rank owns ``num_query_groups / tp`` query groups (so
  ``num_attention_heads / tp`` heads) -- QKV is a column-parallel linear, the
  output projection a row-parallel one;
* MLP: column-parallel up-projection (SwiGLU: gate and up, each split), row-
  parallel down-projection;
* head: logits for this rank's vocabulary slice only -- from the embedding
  weight, or the untied ``output_layer`` split the same way -- fed straight
  into the vocab-parallel cross-entropy, so full logits never exist on one rank.

With ``sequence_parallel`` (TP > 1) the residual stream between the TP regions
-- embeddings, norms, dropout, residual adds -- holds this rank's chunk of
the sequence, ``(B, T / tp, C)``: the embedding reduce-scatters, every
column-parallel layer all-gathers its input, every row-parallel layer
reduce-scatters its output, and the final norm's output is gathered before
the head. Each rank now holds different tokens there, so that dropout draws
from the per-TP-rank stream, and the replicated parameters used there get
their gradients summed over TP (see :mod:`hybrid.tensor_parallel.layers`).

With context parallelism (``context_parallel``, a
:class:`hybrid.tensor_parallel.cp_attention.ContextParallel`) each CP rank is
given its share of every sequence, ``(B, T / cp)`` tokens at the global
positions the CP layout assigns it; position embeddings and RoPE read those
positions, attention reaches the other ranks' keys, and the loss is the mean
over the whole sequence (one all-reduce over CP). Nothing else changes: CP
holds no parameter of its own, and a replicated parameter's gradient is
summed over CP by whoever reduces gradients (hybrid.zero, over DP x CP).

With pipeline parallelism a rank builds one stage of the model (Megatron's
``pre_process`` / ``post_process``): ``layers``, the global indices of the
blocks it holds; the first stage also the embeddings, the last the final norm,
the head and the loss. ``forward`` then takes the previous stage's hidden
states instead of tokens and returns its own for the next stage, ``(B, T, C)``
(``(B, T / tp, C)`` under SP). Blocks keep their global index as their name
(``blocks.7.attn...``), so parameter names -- checkpoint keys and the seeds
of the init by name -- are the same at every pipeline size. With tied
embeddings a last stage that is not also the first holds a copy of ``wte``
for its head: the init by name gives it the first stage's values, and whoever
reduces gradients sums the two copies' gradients (the embedding group).
Under interleaving (virtual stages) a rank holds several model chunks, stages
r, r + p, ...: ``layers`` is then one range per chunk, every chunk's blocks sit
in the one ``blocks`` list (still by global index), and ``forward(..., chunk=c)``
runs chunk c -- the embeddings on the first rank's chunk 0, the head and loss on
the last rank's last chunk. One module holds them all, so names, ``blocks`` and
whatever wraps the model from outside stay as they are; :meth:`GPT.chunk_parameters`
tells a gradient reducer which parameters one chunk's backward reaches.

Shapes: B batch, T sequence, C hidden, V padded vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.config.architecture import NORMALIZATIONS, POSITION_EMBEDDING_TYPES
from hybrid.config.model import ModelConfig
from hybrid.parallel.comm import CommGroup
from hybrid.tensor_parallel import (
    ColumnParallelLinear,
    Init,
    TPRNGTracker,
    VocabParallelEmbedding,
    column_parallel_linear,
    init_parameters,
    sequence_parallel_param,
    vocab_parallel_cross_entropy,
)
from hybrid.tensor_parallel.cp_attention import ContextParallel
from hybrid.tensor_parallel.weight_grad import WeightGradStore
from models.blocks import Block, make_norm, residual_rng
from models.moe import AuxLossScale, MoELayer


class LayerRange(nn.ModuleList):
    """A stage's blocks, the i-th registered under its global layer index ``ids[i]``, so
    a parameter is named as in the whole model; indexed and iterated as a list. ``ids``
    ascend, with gaps between an interleaved rank's chunks (0, 1, 4, 5)."""

    def __init__(self, ids: Sequence[int], modules=()):
        self.ids = tuple(ids)
        super().__init__(modules)

    def _get_abs_string_index(self, idx):
        return str(self.ids[int(super()._get_abs_string_index(idx))])

    def append(self, module: nn.Module) -> LayerRange:
        if len(self) >= len(self.ids):
            raise IndexError(f"the stage holds layers {self.ids}: no room for another block")
        self.add_module(str(self.ids[len(self)]), module)
        return self

    def extend(self, modules) -> LayerRange:
        for m in modules:
            self.append(m)
        return self


class GPT(nn.Module):
    """GPT language model (GPT-2 or Llama-shaped, see the module doc) over the TP
    group of ``tp_group``.

    ``forward(tokens)`` returns this rank's logits ``(B, T, V / tp)``;
    ``forward(tokens, labels)`` returns the mean token loss (a scalar, equal on
    every TP rank).
    """

    def __init__(self, cfg: ModelConfig, tp_group: CommGroup, rng: TPRNGTracker | None = None,
                 seed: int = 1234, device: torch.device | str = "cpu",
                 sequence_parallel: bool = False, context_parallel: ContextParallel | None = None,
                 layers: range | Sequence[range] | None = None, pre_process: bool = True,
                 post_process: bool = True, split_backward: bool = False,
                 ep_group: CommGroup | None = None, etp_group: CommGroup | None = None,
                 dp_group: CommGroup | None = None):
        """Build ``cfg`` (its ``vocab_size`` known) over ``tp_group`` on ``device`` and
        draw the init from ``seed`` -- or, with ``device="meta"``, only shapes: ZeRO then
        materializes what each rank keeps (``apply_zero(..., values=InitValues(seed,
        model.init_of))``). ``sequence_parallel`` (the parallel section's, TP > 1): see
        the module doc; decided here, for every layer at once; so is ``context_parallel``.
        ``layers``, ``pre_process``, ``post_process``: one pipeline stage (module doc);
        default the whole model; a sequence of ranges: an interleaved rank's chunks, in
        model order (the first chunk's the embeddings, the last's the head, by the two
        flags). ``split_backward``: a zero-bubble schedule splits each backward into its
        input and weight halves: the model makes ``weight_grads``, a
        :class:`~hybrid.tensor_parallel.weight_grad.WeightGradStore` its column- and
        row-parallel linears and its head defer their weight gradients to while the
        executor's input half runs (None without the flag: plain linears). ``ep_group``:
        the MoE layers' experts split over this expert-parallel group (None: every
        expert on every rank); ``etp_group``: each expert's hidden units split over this
        expert-tensor-parallel group (None: whole); ``dp_group``: the data-parallel group
        over which ``global_aux_loss`` counts (None: this rank's micro-batches alone)."""
        super().__init__()
        chunks = _chunks(cfg, layers, pre_process and post_process)
        if cfg.vocab_size is None:
            raise ValueError("the model needs its vocabulary: build it from "
                             "cfg.with_vocab_size(tokenizer.vocab_size)")
        if cfg.kv_channels is None and cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not divisible by "
                             f"num_attention_heads {cfg.num_attention_heads}")
        if tp_group.size > 1 and cfg.attention_dropout > 0 and rng is None:
            raise ValueError("attention dropout under TP needs the TP RNG tracker (rng=...)")
        if sequence_parallel and tp_group.size == 1:
            raise ValueError("sequence parallelism needs a TP group of 2 or more ranks")
        if (sequence_parallel or context_parallel) and cfg.hidden_dropout > 0 and rng is None:
            raise ValueError("dropout under sequence or context parallelism needs the RNG "
                             "tracker (rng=...)")
        _check_architecture(cfg)
        self.cfg = cfg
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.cp = context_parallel
        self.padded_vocab_size = cfg.padded_vocab_size(tp_group.size)  # embedding rows, all ranks
        self.pre_process, self.post_process = pre_process, post_process
        self.chunks = chunks  # each chunk's global layer numbers
        self.split_backward = split_backward
        self.weight_grads = WeightGradStore() if split_backward else None
        wg = self.weight_grads
        tied = not cfg.untie_embeddings_and_output_weights
        # SP's and CP's residual stream holds other tokens on each rank: its dropout forks
        self.fork_residual_rng = ((sequence_parallel or context_parallel is not None)
                                  and cfg.hidden_dropout > 0)
        with torch.device(device):
            if pre_process or (post_process and tied):  # the last stage's: the head's copy
                self.wte = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size,
                                                  tp_group, sequence_parallel=sequence_parallel)
            if pre_process and cfg.position_embedding_type == "learned_absolute":
                # _weight: no reset_parameters, whose normal_ on the meta device imports
                # torch._dynamo (a second of start-up); init_parameters draws it below
                self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                        _weight=torch.empty(cfg.max_position_embeddings,
                                                            cfg.hidden_size))
            self.drop = nn.Dropout(cfg.hidden_dropout)
            ids = [i for r in chunks for i in r]
            # the MoE layers' losses get the step's backward factor ([Note: the MoE
            # losses' gradient] in models/moe.py): one holder for the model's layers
            self.moe_loss_scale = AuxLossScale()
            self.blocks = LayerRange(ids, (Block(cfg, tp_group, rng, sequence_parallel,
                                                 context_parallel, wg,
                                                 self.moe_loss_scale if cfg.is_moe_layer(i)
                                                 else None, ep_group, etp_group,
                                                 dp_group)
                                           for i in ids))
            if post_process:
                self.ln_f = make_norm(cfg, tp_group, sequence_parallel)
            if post_process and not tied:  # rows split like wte's
                self.output_layer = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size,
                                                         tp_group, bias=False, weight_grads=wg)
        self.rng = rng
        # Padded vocabulary columns on this rank (ids >= vocab_size) are left out of
        # the loss (and masked to -inf in returned logits), so padding never changes
        # it: the model is the same function for any TP size though the padding is not.
        local = self.padded_vocab_size // tp_group.size  # (VocabParallelEmbedding's rows)
        self.vocab_start = tp_group.rank * local
        self._valid_local = max(0, min(cfg.vocab_size - self.vocab_start, local))
        if torch.device(device).type != "meta":
            init_parameters(self, seed, self.init_of)

    def init_of(self, name: str) -> Init:
        """How parameter ``name``'s full value is drawn (GPT-2's init, Megatron's too)."""
        cfg = self.cfg
        if name.endswith("bias"):
            return Init("zeros")
        if ".ln_" in name or name.startswith("ln_f") or name.endswith(
                ("attn.q_norm.weight", "attn.k_norm.weight")):  # (--qk-layernorm's too)
            return Init("ones")
        if name.endswith(("proj.weight", "experts.proj", "shared.proj")):
            # residual projections (an MoE layer's experts' too): scaled by depth (GPT-2)
            return Init("normal", cfg.init_method_std / math.sqrt(2 * cfg.num_layers))
        if name in ("wte.weight", "output_layer.weight"):  # padding rows stay zero
            return Init("normal", cfg.init_method_std, valid_rows=cfg.vocab_size)
        return Init("normal", cfg.init_method_std)

    def init_buffers(self, device: torch.device | str) -> None:
        """Give the model's buffers (the MoE routers' expert biases) their starting values,
        zeros, on ``device``: for a model built on the meta device (shapes only) or made
        empty (``to_empty``), once its parameters are in place."""
        for layer in self.moe_layers().values():
            router = layer.experts.router
            router.expert_bias = torch.zeros_like(router.expert_bias, device=device)

    def moe_layers(self) -> dict[int, MoELayer]:
        """This stage's MoE layers by global layer index (empty for a dense model)."""
        return {i: b.mlp for i, b in zip(self.blocks.ids, self.blocks)
                if isinstance(b.mlp, MoELayer)}

    def chunk_blocks(self, chunk: int) -> list[nn.Module]:
        """The blocks of model chunk ``chunk`` (all of them without interleaving)."""
        start = sum(len(r) for r in self.chunks[:chunk])
        return list(self.blocks)[start: start + len(self.chunks[chunk])]

    def chunk_parameters(self) -> list[list[nn.Parameter]]:
        """Each chunk's parameters, the rank's split in one list per chunk: its blocks',
        and the parameters outside the blocks (embeddings, final norm, head) with the
        chunk that uses them -- the first when this rank embeds, else the last. A
        backward from one chunk's output reaches exactly its list."""
        in_blocks = {id(p) for b in self.blocks for p in b.parameters()}
        rest = [p for p in self.parameters() if id(p) not in in_blocks]
        out = [[p for b in self.chunk_blocks(c) for p in b.parameters()]
               for c in range(len(self.chunks))]
        out[0 if self.pre_process else -1][:0] = rest
        return out

    def forward(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                chunk: int = 0) -> torch.Tensor:
        """Logits ``(B, T, V / tp)`` of this TP rank's vocabulary shard, or with ``labels``
        ``(B, T)`` the mean cross-entropy over the tokens; with ``loss_mask`` ``(B, T)``
        (1 = counts) the mean over the tokens it keeps (``--eod-mask-loss``). With context
        parallelism T is this CP rank's share (see the module doc). A pipeline stage
        after the first takes the previous stage's ``hidden`` instead of ``tokens``, and
        one before the last returns its hidden states ``(B, T, C)`` (``(B, T / tp, C)``
        under SP) instead of logits or a loss. ``chunk``: which of an interleaved rank's
        model chunks runs (module doc); the embeddings belong to chunk 0, the head to
        the last."""
        last = chunk == len(self.chunks) - 1
        if self.pre_process and chunk == 0:
            if tokens is None:
                raise ValueError("the first stage's forward takes tokens")
            x = self.embed(tokens)
        elif hidden is None:
            raise ValueError("a pipeline stage after the first takes the previous stage's "
                             "hidden states (hidden=...)")
        else:
            x = hidden
        for block in (self.blocks if len(self.chunks) == 1 else self.chunk_blocks(chunk)):
            x = block(x)
        if not (self.post_process and last):
            return x
        return self.head(x, labels, loss_mask)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream's start, ``(B, T, C)`` (``(B, T / tp, C)`` with SP), from
        ``tokens`` ``(B, T)``: token and position embeddings, then dropout."""
        B, T = tokens.shape
        cp = self.cp
        seq = T if cp is None else cp.seq_len(T)
        if seq > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence length {seq} exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        sp, g = self.sequence_parallel, self.tp_group
        x = self.wte(tokens)  # (B, T, C); (B, T / tp, C) with SP
        if self.cfg.position_embedding_type == "learned_absolute":
            pos = (torch.arange(T, device=tokens.device) if cp is None
                   else cp.positions(T, tokens.device))
            if sp:  # this rank's positions, and wpe's gradient summed over TP
                pos = pos.chunk(g.size)[g.rank]
                x = x + F.embedding(pos, sequence_parallel_param(self.wpe.weight, g))
            else:
                x = x + self.wpe(pos)
        with residual_rng(self.fork_residual_rng, self.rng):
            return self.drop(x)

    def head(self, x: torch.Tensor, labels: torch.Tensor | None = None,
             loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and the head on the residual stream ``x``: logits, or with
        ``labels`` the loss (see :meth:`forward`)."""
        sp, g, cp = self.sequence_parallel, self.tp_group, self.cp
        x = self.ln_f(x)
        head = (self.output_layer.weight if self.cfg.untie_embeddings_and_output_weights
                else self.wte.weight)
        if labels is None:  # this rank's whole padded slice (B, T, V / tp), padding -inf
            logits = column_parallel_linear(x, head, None, g, sp,
                                            weight_grads=self.weight_grads)
            if self._valid_local < logits.shape[-1]:
                pad = torch.arange(logits.shape[-1], device=logits.device) >= self._valid_local
                logits = logits.masked_fill(pad, float("-inf"))
            return logits
        # The loss reads the real vocabulary only: the head's GEMMs (forward and both
        # backward), the softmax and its gradient skip this rank's padding rows, whose
        # gradient is zero either way. Slices then differ in width (the last ranks'
        # may be empty), so the cross-entropy is told where this one starts.
        logits = column_parallel_linear(x, head, None, g, sp, rows=self._valid_local,
                                        weight_grads=self.weight_grads)
        # (nothing reads the logits after: their storage may hold the softmax)
        losses = vocab_parallel_cross_entropy(logits, labels, g, start=self.vocab_start,
                                              scratch=True)
        if cp is not None:  # the whole sequence's mean, equal on every CP rank
            return cp.mean_loss(losses, loss_mask)
        if loss_mask is None:
            return losses.mean()
        # a micro-batch of end-of-document tokens only counts nothing (not 0 / 0)
        return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def _chunks(cfg: ModelConfig, layers: range | Sequence[range] | None,
            whole: bool) -> tuple[range, ...]:
    """The global layers of each model chunk a rank builds (:class:`GPT`'s ``layers``:
    None, the whole model; a range, one stage; ranges, an interleaved rank's chunks);
    ValueError for anything else, or for chunks on a rank that is both first and last
    (``whole``)."""
    chunks = ((range(cfg.num_layers),) if layers is None
              else (layers,) if isinstance(layers, range) else tuple(layers))
    stop = 0
    for r in chunks:
        if r.step != 1 or r.start < stop or r.stop > cfg.num_layers:
            raise ValueError(f"layers {layers} is not a run of the model's "
                             f"{cfg.num_layers} (or ascending runs, one per chunk)")
        stop = max(stop, r.stop)
    if not chunks or (len(chunks) > 1 and whole):
        raise ValueError("model chunks interleave over pipeline ranks: one rank holds "
                         "the embeddings or the head, not both")
    return chunks


def _check_architecture(cfg: ModelConfig) -> None:
    """ValueError for a model section no model can be built from (the flags are checked,
    naming them, by :func:`hybrid.config.build_config`)."""
    if cfg.normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization {cfg.normalization!r} is not one of {NORMALIZATIONS}")
    if cfg.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ValueError(f"position_embedding_type {cfg.position_embedding_type!r} is not one "
                         f"of {POSITION_EMBEDDING_TYPES}")
    if cfg.num_attention_heads % cfg.query_groups:
        raise ValueError(f"num_attention_heads {cfg.num_attention_heads} is not divisible by "
                         f"num_query_groups {cfg.query_groups}")
    if cfg.position_embedding_type == "rope" and (cfg.rotary_dim < 2 or cfg.rotary_dim % 2):
        raise ValueError(f"rotary_percent {cfg.rotary_percent} of head size {cfg.head_size} "
                         f"gives {cfg.rotary_dim} rotated channels; RoPE needs an even number")
