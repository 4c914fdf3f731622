"""megatron-core's GPTModel parameter names and layouts <-> hybrid's GPT: the one table.

Megatron's layer ``N`` of ``decoder.layers.N.<rest>`` is hybrid's ``blocks.N.<part>``
(a ``torch_dist`` checkpoint stacks the layers: one tensor ``decoder.layers.<rest>`` of
shape ``(num_layers, ...)``); the rest maps one to one. Two layouts are the same on both
sides and need no permutation:

* the fused QKV (``self_attention.linear_qkv``) is laid out per query group -- the
  group's query heads, then its key head, then its value head, group after group --
  as hybrid's ``attn.qkv``;
* SwiGLU's ``mlp.linear_fc1`` holds ``[gate; up]`` as ``(2F, C)`` (megatron-core's
  swiglu sharded factory saves each TP rank's gate and up halves at their places in
  the full gate and the full up), hybrid's ``mlp.fc`` the same numbers as ``(2, F, C)``.

A mixture-of-experts layer (megatron-core's local spec: ``TopKRouter``, ``SequentialMLP``)
maps its router ``mlp.router.weight`` ``(E, C)`` to hybrid's ``mlp.experts.router.weight``
and its experts to hybrid's stacked ``mlp.experts.fc`` ``(E, 2F, C)`` and
``mlp.experts.proj`` ``(E, C, F)``: ``torch_dist`` saves each EP rank's local experts
``local_experts.K`` at their global index on an expert axis, ``mlp.experts.experts.
linear_fc1.weight`` of shape ``(num_layers, E, 2F, C)`` -- each expert's rows
``[gate; up]``, hybrid's order -- so the EP ranks' pieces are one tensor already.

Megatron-LM's older names, which Megatron-DeepSpeed keeps (``query_key_value``,
``dense``, ``post_attention_layernorm``, ``dense_h_to_4h``, ``dense_4h_to_h``), are read as
their megatron-core counterparts (never written): the older QKV's rows per head,
``[np, 3, hn]``, are the per-query-group layout above with one query head a group.

Megatron's input and pre-MLP norms are named by the linear they feed
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``: Transformer
Engine's fused modules, and what the local spec's ``sharded_state_dict`` saves them as
too); its unfused modules' own names (``input_layernorm``, ``pre_mlp_layernorm``) are
read as well. Pure name and tensor functions: no torch.distributed, no megatron import.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection

import torch

# Megatron's per-layer name (after "decoder.layers.[N.]") -> hybrid's (after "blocks.N.");
# the first name of a hybrid part is the one written back
LAYER: tuple[tuple[str, str], ...] = (
    ("self_attention.linear_qkv.layer_norm_weight", "ln_1.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "ln_1.bias"),
    ("input_layernorm.weight", "ln_1.weight"),
    ("input_layernorm.bias", "ln_1.bias"),
    ("self_attention.linear_qkv.weight", "attn.qkv.weight"),
    ("self_attention.linear_qkv.bias", "attn.qkv.bias"),
    ("self_attention.query_key_value.weight", "attn.qkv.weight"),
    ("self_attention.query_key_value.bias", "attn.qkv.bias"),
    ("self_attention.q_layernorm.weight", "attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "attn.k_norm.weight"),
    ("self_attention.linear_proj.weight", "attn.proj.weight"),
    ("self_attention.linear_proj.bias", "attn.proj.bias"),
    ("self_attention.dense.weight", "attn.proj.weight"),
    ("self_attention.dense.bias", "attn.proj.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "ln_2.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "ln_2.bias"),
    ("pre_mlp_layernorm.weight", "ln_2.weight"),
    ("pre_mlp_layernorm.bias", "ln_2.bias"),
    ("post_attention_layernorm.weight", "ln_2.weight"),
    ("post_attention_layernorm.bias", "ln_2.bias"),
    ("mlp.linear_fc1.weight", "mlp.fc.weight"),
    ("mlp.linear_fc1.bias", "mlp.fc.bias"),
    ("mlp.dense_h_to_4h.weight", "mlp.fc.weight"),
    ("mlp.dense_h_to_4h.bias", "mlp.fc.bias"),
    ("mlp.linear_fc2.weight", "mlp.proj.weight"),
    ("mlp.linear_fc2.bias", "mlp.proj.bias"),
    ("mlp.dense_4h_to_h.weight", "mlp.proj.weight"),
    ("mlp.dense_4h_to_h.bias", "mlp.proj.bias"),
    # a mixture of experts (the local spec's TopKRouter and SequentialMLP): the router's
    # (E, C) logit weight (a sigmoid router's expert_bias is not mapped: refused); each
    # expert's linears, saved under their global expert index as one (E, ...) tensor per
    # layer -- [gate; up] rows per expert, as hybrid's (E, 2F, C)
    ("mlp.router.weight", "mlp.experts.router.weight"),
    ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.fc"),
    ("mlp.experts.experts.linear_fc2.weight", "mlp.experts.proj"),
)

# the parameters outside the layers
GLOBAL: tuple[tuple[str, str], ...] = (
    ("embedding.word_embeddings.weight", "wte.weight"),
    ("embedding.position_embeddings.weight", "wpe.weight"),
    ("decoder.final_layernorm.weight", "ln_f.weight"),
    ("decoder.final_layernorm.bias", "ln_f.bias"),
    ("output_layer.weight", "output_layer.weight"),
)

# the linears whose (empty) Transformer Engine ``_extra_state`` megatron-core's
# GPTModel saves and loads, per layer
EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
               "mlp.linear_fc2")

# The order megatron-core's GPTModel registers a layer's parameters in (its
# ``named_parameters()``; the distributed optimizer's buffers hold them in the reverse of
# the model's order), as hybrid parts, for its two layer specs: the local one (norms as
# modules of their own, before the attention and the MLP; the attention's output
# projection is made before its fused QKV) -- checked on megatron-core 0.16.1's buffers --
# and Transformer Engine's (the norms inside the linears they feed), as read from its
# modules. The parameters outside the layers: the embeddings first, the final norm and the
# output layer last.
LAYER_ORDER = {
    "local": ("ln_1.weight", "ln_1.bias", "attn.proj.weight", "attn.proj.bias",
              "attn.qkv.weight", "attn.qkv.bias", "attn.q_norm.weight", "attn.k_norm.weight",
              "ln_2.weight", "ln_2.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight",
              "mlp.proj.bias"),
    "transformer_engine": ("attn.proj.weight", "attn.proj.bias", "ln_1.weight", "ln_1.bias",
                           "attn.qkv.weight", "attn.qkv.bias", "attn.q_norm.weight",
                           "attn.k_norm.weight", "ln_2.weight", "ln_2.bias", "mlp.fc.weight",
                           "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"),
}
HEAD_ORDER = ("wte.weight", "wpe.weight")
TAIL_ORDER = ("ln_f.weight", "ln_f.bias", "output_layer.weight")


def model_order(names: list[str], spec: str) -> list[str]:
    """``names`` (hybrid's, of one GPT) in megatron-core's GPTModel parameter order under
    layer spec ``spec`` (a key of :data:`LAYER_ORDER`)."""
    rank = {part: j for j, part in enumerate(LAYER_ORDER[spec])}

    def key(name: str) -> tuple:
        m = _BLOCK.fullmatch(name)
        if m:
            return (1, int(m.group(1)), rank.get(m.group(2), len(rank)))
        if name in HEAD_ORDER:
            return (0, HEAD_ORDER.index(name), 0)
        return (2, TAIL_ORDER.index(name) if name in TAIL_ORDER else len(TAIL_ORDER), 0)
    return sorted(names, key=key)


LAYERS_PREFIX = "decoder.layers."
_LAYER_TO_HYBRID = dict(LAYER)
_GLOBAL_TO_HYBRID = dict(GLOBAL)
_HYBRID_TO_LAYER = {h: m for m, h in reversed(LAYER)}  # (the first one listed wins)
_HYBRID_TO_GLOBAL = {h: m for m, h in GLOBAL}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def layer_part(megatron_rest: str) -> str | None:
    """hybrid's name within a block for Megatron's per-layer name, or None."""
    return _LAYER_TO_HYBRID.get(megatron_rest)


def global_part(megatron_name: str) -> str | None:
    """hybrid's name for one of Megatron's parameters outside the layers, or None."""
    return _GLOBAL_TO_HYBRID.get(megatron_name)


def to_megatron(hybrid_name: str) -> tuple[int | None, str]:
    """(layer, Megatron's name) for hybrid's ``hybrid_name``: the layer's index and the
    name after ``decoder.layers.`` for a block's parameter, (None, full name) otherwise.
    KeyError for a name Megatron's GPTModel has no place for."""
    m = _BLOCK.fullmatch(hybrid_name)
    if m:
        return int(m.group(1)), _HYBRID_TO_LAYER[m.group(2)]
    return None, _HYBRID_TO_GLOBAL[hybrid_name]


def is_swiglu_fc(hybrid_name: str, swiglu: bool) -> bool:
    return swiglu and hybrid_name.endswith("mlp.fc.weight") or (
        swiglu and hybrid_name.endswith("mlp.fc.bias"))


def to_hybrid_layout(hybrid_name: str, t: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """Megatron's tensor of ``hybrid_name`` in hybrid's layout: SwiGLU's ``(2F, ...)``
    as ``(2, F, ...)``; everything else as it is."""
    if is_swiglu_fc(hybrid_name, swiglu):
        return t.reshape(2, t.shape[0] // 2, *t.shape[1:])
    return t


def to_megatron_layout(hybrid_name: str, t: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """Inverse of :func:`to_hybrid_layout`."""
    if is_swiglu_fc(hybrid_name, swiglu):
        return t.reshape(-1, *t.shape[2:])
    return t


# How Megatron's TP ranks split each hybrid part in its per-rank (legacy ``torch``)
# files: the dimension cut, column-parallel (0: the vocabulary rows, QKV's query groups,
# the MLP's first linear) or row-parallel (1); the rest is the same on every rank
_TP_DIM = {"wte.weight": 0, "output_layer.weight": 0, "attn.qkv.weight": 0,
           "attn.qkv.bias": 0, "mlp.fc.weight": 0, "mlp.fc.bias": 0,
           "attn.proj.weight": 1, "mlp.proj.weight": 1}


def tp_dim(hybrid_name: str) -> int | None:
    """The dimension Megatron's TP ranks cut ``hybrid_name`` along, or None."""
    m = _BLOCK.fullmatch(hybrid_name)
    return _TP_DIM.get(m.group(2) if m else hybrid_name)


def merge_tp(hybrid_name: str, shards: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """TP ranks' pieces of one parameter (Megatron's layout, rank order) as the full
    tensor in hybrid's layout. A SwiGLU ``linear_fc1`` rank holds ``[its gate rows; its
    up rows]``: the gates go together, then the ups."""
    dim = tp_dim(hybrid_name)
    if dim is None or len(shards) == 1:
        return to_hybrid_layout(hybrid_name, shards[0], swiglu)
    if is_swiglu_fc(hybrid_name, swiglu):
        halves = [t.reshape(2, t.shape[0] // 2, *t.shape[1:]) for t in shards]
        return torch.cat(halves, dim=1)
    return torch.cat(shards, dim=dim)


def split_tp(hybrid_name: str, t: torch.Tensor, tp: int, swiglu: bool) -> list[torch.Tensor]:
    """Inverse of :func:`merge_tp`: hybrid's full tensor as its ``tp`` ranks' pieces in
    Megatron's layout (a SwiGLU ``linear_fc1`` rank: ``[its gate rows; its up rows]``);
    a part TP does not cut is the whole tensor on every rank."""
    dim = tp_dim(hybrid_name)
    if dim is None or tp == 1:
        return [to_megatron_layout(hybrid_name, t, swiglu)] * tp
    if is_swiglu_fc(hybrid_name, swiglu):
        return [h.reshape(-1, *h.shape[2:]) for h in t.chunk(tp, dim=1)]
    return list(t.chunk(tp, dim=dim))


# the grad buffers' (param dtype, grad dtype) pairs hybrid reads and writes, as megatron-core
# names them in its dp_reshardable keys (``dtype_(torch.bfloat16, torch.float32)``): an fp32
# run's, and a bf16 run's with its grads reduced in fp32 (Megatron-LM's default under --bf16,
# --accumulate-allreduce-grads-in-fp32) or in bf16. The optimizer state is fp32 in each;
# only the key and the model's weights differ
BUFFER_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                 (torch.bfloat16, torch.bfloat16))


def buffer_dtypes(bf16: bool, grads_in_fp32: bool) -> tuple[torch.dtype, torch.dtype]:
    """The grad buffer's (param dtype, grad dtype) of a run in bf16 or fp32 (one of
    :data:`BUFFER_DTYPES`)."""
    if not bf16:
        return (torch.float32, torch.float32)
    return (torch.bfloat16, torch.float32 if grads_in_fp32 else torch.bfloat16)


# megatron-core's grad buffer (``_ParamAndGradBuffer`` under the distributed optimizer):
# each parameter starts at a multiple of 64 values, and each bucket's end is padded to a
# multiple of lcm(DP, 128) so that it splits evenly into the DP ranks' shards
PARAM_ALIGN = 64
BUCKET_ALIGN = 128


def bucket_layout(numels: list[tuple[str, int]], closes, alone: Collection[str] = ()
                  ) -> tuple[dict[str, tuple[int, int, int]], list[int]]:
    """Where megatron-core's grad buffer puts one TP rank's parameters of one PP stage:
    ``numels`` are (name, TP-local numel) in the buffer's order (the GPTModel's parameter
    order reversed, :func:`model_order`); each starts at the next multiple of
    :data:`PARAM_ALIGN` after the one before, counted from its bucket's start, and
    ``closes(bucket, stop)`` says whether the bucket ends after a parameter ending at
    ``stop`` (megatron: ``stop >= bucket_size``; the last bucket ends after the last
    parameter). A name in ``alone`` (the shared word embeddings at PP > 1,
    :func:`stage_buffer`) gets a bucket of its own: the bucket before it, when it holds a
    parameter, ends where the aligned start would have been. Returns ({name: (bucket,
    start, stop)} in bucket coordinates, each bucket's unpadded numel)."""
    out: dict[str, tuple[int, int, int]] = {}
    sizes: list[int] = []
    bucket, pos = 0, 0
    for name, n in numels:
        start = -(-pos // PARAM_ALIGN) * PARAM_ALIGN
        if name in alone and pos:  # (megatron counts the alignment into the closed bucket)
            sizes.append(start)
            bucket, start = bucket + 1, 0
        out[name] = (bucket, start, start + n)
        pos = start + n
        if name in alone or closes(bucket, pos):
            sizes.append(pos)
            bucket, pos = bucket + 1, 0
    if pos:  # (the last bucket, still open)
        sizes.append(pos)
    return out, sizes


# The last PP stage's copy of tied word embeddings (megatron-core's output layer weight
# there): a parameter of that stage's buffer as the output layer is at the end of the
# model, its master and moments those of the first stage's word embeddings (their
# gradients are summed across the two stages before each step)
TIED_COPY = "output_layer.weight (tied)"


def pipeline_stages(params: list[str], num_layers: int, pp: int, tied: bool
                    ) -> list[list[str]]:
    """Each PP stage's parameters (hybrid's names) in Megatron-LM's even split:
    ``num_layers / pp`` consecutive layers a stage (:func:`split_stages` of that split).
    ValueError when ``pp`` does not divide ``num_layers`` (the callers name their flag
    first)."""
    if pp == 1:
        return [list(params)]
    if num_layers < 1 or num_layers % pp:
        raise ValueError(f"PP {pp} does not split {num_layers} layers evenly")
    return split_stages(params, [num_layers // pp] * pp, tied)


def split_stages(params: list[str], counts: list[int], tied: bool) -> list[list[str]]:
    """Each pipeline piece's parameters (hybrid's names), the split both the reader and
    the writer of dp_reshardable use: piece ``i`` holds the next ``counts[i]`` layers in
    model order (Megatron-LM's split, even or with an uneven first or last stage:
    :func:`hybrid.config.stage_split.split_layers`'s ``layers``), the embeddings on the
    first piece, the final norm and the output layer on the last, and with ``tied`` (more
    than one piece) the last piece's :data:`TIED_COPY`."""
    if len(counts) == 1:
        return [list(params)]
    owner = [i for i, n in enumerate(counts) for _ in range(n)]  # layer -> piece
    out: list[list[str]] = [[] for _ in counts]
    for name in params:
        m = _BLOCK.fullmatch(name)
        out[owner[int(m.group(1))] if m else 0 if name in HEAD_ORDER else -1].append(name)
    if tied:
        out[-1].append(TIED_COPY)
    return out


def stage_buffer(stages: list[list[str]], stage: int, spec: str, numel, closes
                 ) -> tuple[dict[str, tuple[int, int, int]], list[int]]:
    """One (PP stage, TP rank)'s grad buffer: stage ``stage`` of ``stages``
    (:func:`split_stages`) in the reverse of the GPTModel's order under layer spec
    ``spec``, ``numel(name)`` each parameter's TP-local numel (:data:`TIED_COPY`'s is the
    word embeddings'), laid out by :func:`bucket_layout` with ``closes``. With tied
    embeddings at PP > 1 megatron-core marks the word embeddings and their copy
    ``shared_embedding``, and its distributed optimizer's buffer gives each a bucket of
    its own (the two stages' shards then line up)."""
    shared = {"wte.weight", TIED_COPY} if any(TIED_COPY in s for s in stages) else set()
    order = model_order(stages[stage], spec)[::-1]
    return bucket_layout([(n, numel(n)) for n in order], closes, shared)


def ddp_closes(stage: int, bucket_size: int | None):
    """``closes`` for :func:`stage_buffer` of a run with DDP bucket size ``bucket_size``
    (None: one bucket, no ``--overlap-grad-reduce``): megatron-core's
    DistributedDataParallel buckets by size on the first PP stage only; a later stage's
    buffer is one bucket (bar the shared embeddings' own)."""
    return lambda b, stop: stage == 0 and bucket_size is not None and stop >= bucket_size


def padded_bucket(unpadded: int, dp: int) -> int:
    """A bucket's numel in the buffer at DP size ``dp`` (its end padded: each DP rank's
    shard is ``padded // dp``)."""
    step = math.lcm(dp, BUCKET_ALIGN)
    return -(-unpadded // step) * step


# hybrid's stacked experts of an MoE layer, ``(E, ...)`` each: megatron-core's
# ``linear_fc1`` and ``linear_fc2`` of every local expert (SequentialMLP)
EXPERTS = ("mlp.experts.fc", "mlp.experts.proj")


def expert_buffer(shapes: dict[str, list[int]], ep: int, closes
                  ) -> tuple[list[tuple[str, int]], dict[tuple[str, int], tuple[int, int, int]],
                             list[int]]:
    """One EP rank's expert grad buffer (megatron-core's second DDP buffer, the same on
    every EP rank): its ``E / ep`` local experts -- layer after layer, local expert after
    local expert, ``linear_fc1`` then ``linear_fc2``, each one parameter of its own -- in
    the reverse of that order, laid out by :func:`bucket_layout` with ``closes``.
    ``shapes``: hybrid's full shapes (the experts' ``(E, ...)`` among them). Returns (the
    model order, [(name, local expert)]; {(name, local expert): (bucket, start, stop)};
    each bucket's unpadded numel). EP rank ``e``'s local expert ``k`` is global expert
    ``e * E / ep + k``."""
    experts = [n for n in shapes if n.endswith(EXPERTS)]
    experts.sort(key=lambda n: (int(n.split(".")[1]), n.endswith(EXPERTS[1])))
    local = shapes[experts[0]][0] // ep if experts else 0
    layers: dict[str, list[str]] = {}
    for n in experts:
        layers.setdefault(n.rsplit(".mlp.", 1)[0], []).append(n)
    order = [(n, k) for pair in layers.values() for k in range(local) for n in pair]
    numel = {n: math.prod(shapes[n][1:]) for n in experts}
    keyed = {f"{n}/{k}": (n, k) for n, k in order}
    placed, sizes = bucket_layout([(f"{n}/{k}", numel[n]) for n, k in reversed(order)], closes)
    return order, {keyed[key]: at for key, at in placed.items()}, sizes
