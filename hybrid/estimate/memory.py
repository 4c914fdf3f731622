"""Peak memory per rank: model states, activations, gather buffers, communication buckets.

:func:`peak_memory` adds up what one rank holds at its high-water mark, which
for a GPT trained by hybrid is early in backward: every activation still
saved, the output head's softmax, the gathered and not yet reduced units, and
the staging buffers. Each term is written out below;
``tests/estimate/test_memory_estimate.py`` checks the activation terms byte for byte
against what autograd saves, and ``benchmarks/bench_memory.py`` checks the total
against measured peaks. :func:`choose_stage` picks the ZeRO stage with the least
traffic whose peak fits a device (``scripts/estimate_memory.py``).

[Note: activations per layer]
Saved for backward by one transformer layer (s sequence, b micro-batch, h
hidden, f MLP width, t TP size, a heads, e bytes per activation element), with
an attention kernel that keeps no s x s scores (flash / memory-efficient
SDPA)::

    replicated over TP: LN-1 input and output, LN-2 input and output     4 sbh e
    split over TP:      QKV output (SDPA keeps q, k, v as views of it)    3 sbh e / t
                        attention output (also the projection's input)    1 sbd e / t
                        MLP up output (GELU input) and GELU output        2 sbf e / t
    statistics:         two LayerNorms' mean and 1/std (fp32 on CUDA,   16 sb
                        the input's dtype on the CPU)
                        SDPA's log-sum-exp per head (fp32)                4 sb a / t

Here ``d`` is the attention's width, heads x head size: ``h`` unless
``--kv-channels`` gives the heads their own width (then the QKV output is
``(a + 2g) kv_channels`` wide as well). ``--qk-layernorm`` adds the QKV output
its norms keep (their input) and their statistics per query and key head; the
normalized QKV then stands where the QKV output stood in the terms above.

The Llama-family options change three terms. With ``g`` query groups the QKV
output is ``(a + 2g) / a`` sbh wide: with GQA or RoPE it is split into fresh
q, k, v tensors (RoPE applied) that SDPA keeps instead, the same bytes, and
the QKV output itself is freed. SwiGLU keeps its ``2f``-wide input and its
``f``-wide output (``3 sbf e / t``; silu is recomputed in backward). RMSNorm
keeps one fp32 ``1/rms`` per row instead of LayerNorm's two statistics
(``8 sb`` for two norms). RoPE and ``none`` positions save no position ids;
biases and an untied output layer save nothing more (the head's input is the
final norm's output either way).

This is Korthikanti et al. 2022's ``sbh (10 + 24/t)`` for 16-bit activations
(f = 4h), without their dropout masks and their ``5as/(ht)`` scores term. With
sequence parallelism the replicated terms (LayerNorm inputs and outputs, their
statistics, the dropout masks) are this rank's ``1/t`` of the sequence too --
the column-parallel layers save their local input and gather it again in
backward -- so a layer keeps ``16 sbh e / t`` and its two masks: the paper's
``34 sbh / t`` for 16-bit activations.
Dropout on the two residual branches adds two masks of ``sbh`` elements, one
byte each on CUDA and ``e`` bytes on the CPU (which keeps the scaled noise).
Attention dropout on the CPU runs the math kernel in fp32, which keeps its own
q, k, v (``3 sbh 4 / t`` instead of the QKV output) and the scores: the
softmax, its mask and its output (``3 a s^2 b 4 / t``) instead of the
log-sum-exp. With full recompute a checkpointed layer keeps only its input
(``sbh e``, ``/t`` when partitioned, nothing on the device with
``--cpu-checkpointing``), and during backward one layer's activations exist
again. With Megatron's uniform method and ``--recompute-num-layers k`` the
layers form groups of ``k`` that keep one input each (``ceil(L / k)``
inputs), and a group's backward holds ``k`` layers' activations at once.

The head keeps LN-f input and output (``2 sbh e``) with their statistics, the
token and label ids and the positions, and for the cross-entropy one slice of
``bsV/t`` values: the fp32 softmax on the CPU (PyTorch ops) or the logits
themselves (``e`` bytes, the fused kernel on CUDA). At the end of forward the
logits and their fp32 softmax exist at once.

With context parallelism (``cp`` ranks) every ``s`` above is this rank's
``s = T / cp`` tokens -- layers, head, stored checkpoints and logits alike --
and the attention term is the CP attention's instead
(:mod:`hybrid.estimate.context_parallel`: an fp32 output and the log-sum-exp,
no scores; a2a adds ``16 T`` bytes of index vectors). ZeRO shards and reduces
over DP x CP (``shard_ranks``), and the CP attention's K/V traffic is
reported beside ZeRO's (``traffic_bytes(w)["cp_bytes_per_step"]``).
"""

from __future__ import annotations

from dataclasses import replace

from hybrid.estimate import context_parallel as cp_terms, pipeline as pp_terms
from hybrid.estimate.model_states import BYTES, comm_bytes_per_step, model_state_bytes
from hybrid.estimate.workload import Workload, workload  # noqa: F401 (callers import both here)


def _stat_bytes(w: Workload) -> int:
    """LayerNorm's saved mean and 1/std: fp32 on CUDA, the input's dtype on the CPU."""
    return 4 if w.device == "cuda" else BYTES[w.params_dtype]


def _norm_row_bytes(w: Workload) -> int:
    """Statistics one norm saves per row: LayerNorm's mean and 1/std, RMSNorm's fp32 1/rms."""
    return 2 * _stat_bytes(w) if w.model.normalization == "LayerNorm" else 4


def activation_bytes_per_layer(w: Workload) -> int:
    """Bytes one layer saves for backward without recompute (see the note)."""
    m, b, t = w.model, w.micro_batch_size, w.tp
    s, h, a = w.seq_per_rank, m.hidden_size, m.num_attention_heads
    e = BYTES[w.params_dtype]
    r = _replicated_divisor(w)
    sbh = s * b * h
    sbd = s * b * m.attention_size  # the attention output: sbh unless --kv-channels
    stats = 2 * s * b * _norm_row_bytes(w) // r
    # MLP: GELU's input and output (2f); SwiGLU's [gate | up] input and output (3f)
    mlp = (m.mlp_up_size + m.ffn_size) * s * b
    qkv = m.qkv_size * s * b  # 3 sbh without GQA
    if w.selective_recompute:  # the checkpoint holds the QKV output, SDPA keeps nothing
        saved = 4 * sbh * e // r + (qkv + sbd + mlp) * e // t
        attention = 0
    elif w.cp > 1:  # q, k, v (the QKV term), fp32 output, log-sum-exp: no scores
        saved = 4 * sbh * e // r + (qkv + sbd + mlp) * e // t
        attention = cp_terms.attention_saved_bytes(w)
    elif w.device == "cpu" and m.attention_dropout > 0:
        # the math kernel, in fp32: its own q, k, v (k, v repeated to every query
        # head) and the scores, not the QKV output
        saved = 4 * sbh * e // r + (sbd + mlp) * e // t
        attention = 3 * sbd * 4 // t + 3 * (a // t) * s * s * b * 4
    else:
        saved = 4 * sbh * e // r + (qkv + sbd + mlp) * e // t
        attention = (a // t) * s * b * 4
    if m.qk_layernorm:  # the q and k norms keep the QKV output they read, and stats per head
        saved += qkv * e // t + s * b * (a + m.query_groups) // t * _norm_row_bytes(w)
    masks = 2 * sbh * (1 if w.device == "cuda" else e) // r if m.hidden_dropout > 0 else 0
    return saved + stats + attention + masks


def _replicated_divisor(w: Workload) -> int:
    """What divides the activations TP leaves replicated: TP with sequence parallelism
    (each rank keeps its 1/t of the sequence there), else 1."""
    return w.tp if w.sequence_parallel else 1


def head_bytes(w: Workload) -> int:
    """Bytes saved outside the layers: embedding and head (see the note)."""
    return embedding_bytes(w) + loss_bytes(w)


def embedding_bytes(w: Workload) -> int:
    """What the embedding saves (the first pipeline stage's share of :func:`head_bytes`):
    the token ids and learned positions (int64), at TP > 1 the mask of ids outside this
    rank's vocabulary slice, and the embedding dropout's mask."""
    m, b = w.model, w.micro_batch_size
    s, h = w.seq_per_rank, m.hidden_size
    positions = 8 * s if m.position_embedding_type == "learned_absolute" else 0  # SP: a view
    ids = 8 * s * b + positions + (0 if w.tp == 1 else s * b)
    r = _replicated_divisor(w)
    mask = s * b * h * (1 if w.device == "cuda" else BYTES[w.params_dtype]) // r \
        if m.hidden_dropout > 0 else 0
    return ids + mask


def loss_bytes(w: Workload) -> int:
    """What the head and loss save (the last pipeline stage's share of :func:`head_bytes`):
    the label ids (int64), at TP 1 the loss's weight scalar and at TP > 1 the mask of
    labels outside this rank's vocabulary slice, the final norm's input, output and
    statistics, and the cross-entropy's slice of ``bsV/t`` values."""
    m, b = w.model, w.micro_batch_size
    s, h = w.seq_per_rank, m.hidden_size
    e = BYTES[w.params_dtype]
    r = _replicated_divisor(w)
    ids = 8 * s * b + (4 if w.tp == 1 else s * b)
    ln_f = (2 * s * b * h * e + s * b * _norm_row_bytes(w)) // r
    softmax = (e if w.device == "cuda" else 4) * b * s * w.padded_vocab_size // w.tp
    return ids + ln_f + softmax


def layers_bytes(w: Workload, n: int) -> tuple[int, int]:
    """(bytes ``n`` consecutive layers -- the model, or one pipeline chunk -- save for
    backward under ``w``'s recompute, the transient of a recomputed group's backward).
    Megatron's block method checkpoints the first ``recompute_num_layers`` of them, the
    uniform method groups them ``recompute_layers_per_checkpoint`` at a time (see the
    note)."""
    m, b, t = w.model, w.micro_batch_size, w.tp
    s, h = w.seq_per_rank, m.hidden_size
    e = BYTES[w.params_dtype]
    per_layer = activation_bytes_per_layer(w)
    n_ckpt = min(w.recompute_num_layers or n, n) if w.recompute else 0
    split = w.partition_activations or w.sequence_parallel  # the input is 1/t either way
    stored_input = 0 if w.cpu_checkpointing else s * b * h * e // (t if split else 1)
    k = min(w.recompute_layers_per_checkpoint, n_ckpt) if n_ckpt else 0
    n_stored = -(-n_ckpt // k) if k else 0  # one input per group of k layers
    layers = n_stored * stored_input + (n - n_ckpt) * per_layer
    working = k * per_layer  # a recomputed group during its backward
    if w.selective_recompute:  # one attention core's scores, rerun during its backward
        working = activation_bytes_per_layer(replace(w, selective_recompute=False)) - per_layer
    return layers, working


def activation_bytes(w: Workload) -> dict:
    """{"layers", "head", "recompute_working_set", "peak"}: bytes saved at the end of
    forward, and the most that exists at once (the peak term of :func:`peak_memory`).
    With CP also ``"cp_attention_working_set"``: one layer's attention exchange in
    backward (:func:`hybrid.estimate.context_parallel.attention_working_set`). With PP
    (``w.pp > 1``) those of pipeline stage ``w.stage`` under its schedule, and more
    keys: see :func:`pipeline_activation_bytes`."""
    if w.pp > 1:
        return pipeline_activation_bytes(w)
    m, b, t = w.model, w.micro_batch_size, w.tp
    s = w.seq_per_rank
    e = BYTES[w.params_dtype]
    layers, working = layers_bytes(w, m.num_layers)
    head = head_bytes(w)
    logits = e * b * s * w.padded_vocab_size // t  # beside their softmax
    if w.cp == 1:
        return {"layers": layers, "head": head, "recompute_working_set": working,
                "peak": layers + head + max(working, logits)}
    # a recomputed group's backward runs its attention's too
    attention = cp_terms.attention_working_set(w)
    return {"layers": layers, "head": head, "recompute_working_set": working,
            "cp_attention_working_set": attention,
            "peak": layers + head + max(working + attention, logits)}


def pipeline_activation_bytes(w: Workload) -> dict:
    """Pipeline stage ``w.stage``'s activations under ``w.schedule`` (see [Note:
    activations under a schedule] in :mod:`hybrid.estimate.pipeline`): at the rank's
    peak, ``"layers"`` and ``"head"`` (its chunks' layers, and the embedding's and the
    loss's saved tensors, of every micro-batch then in flight) and ``"outputs"`` (each
    such micro-batch's stage output, which the executor keeps for its backward; none on
    the last stage, whose output is the loss); ``"held"``: those micro-batches (chunk
    activations with interleaving); ``"peak_held"``: the simulator's peak count;
    ``"per_micro_batch"``: one micro-batch's saved bytes on each of the rank's chunks;
    the transients as at PP 1 (the logits only on the rank of the last stage); ``"peak"``."""
    p, v, rank = w.pp, w.vpp, w.stage
    b, s = w.micro_batch_size, w.seq_per_rank
    last = p * v - 1
    per_stage, working = {}, 0
    for c, n in enumerate(w.stage_chunks(rank)):
        st = c * p + rank
        layers, work = layers_bytes(w, n)
        head = (embedding_bytes(w) if st == 0 else 0) + (loss_bytes(w) if st == last else 0)
        per_stage[st] = (layers, head, 0 if st == last else pp_terms.message_bytes(w))
        working = max(working, work)
    at_peak = pp_terms.held_peak(w, rank, per_stage)
    layers, head, outputs = at_peak["bytes"]
    logits = (BYTES[w.params_dtype] * b * s * w.padded_vocab_size // w.tp
              if rank == last % p else 0)
    out = {"layers": layers, "head": head, "outputs": outputs, "held": at_peak["held"],
           "peak_held": at_peak["peak_held"],
           "per_micro_batch": [per_stage[st][0] + per_stage[st][1]
                               for st in sorted(per_stage)],
           "recompute_working_set": working}
    transient = working
    if w.cp > 1:
        out["cp_attention_working_set"] = attention = cp_terms.attention_working_set(w)
        transient += attention
    out["peak"] = layers + head + outputs + max(transient, logits)
    return out


def buffer_bytes(w: Workload) -> dict:
    """ZeRO's buffers beyond the model states at the backward peak.

    ``gathered``: stage 3 keeps the root unit (embeddings, final norm; with PP its
    stage's share, :attr:`Workload.root_psi`) whole for the whole step, plus the running
    and the prefetched block; a pipeline step by default (:attr:`Workload.holds_stage`)
    holds its whole stage, ``e_p Psi``, from its first forward to its last backward. ``grads``: a
    unit's ``param.grad`` waits until its last gradient arrives and it is
    reduced (stages 2-3: the running unit plus the root or last bucket, which
    holds the head's embedding gradient through backward; with fp32 gradients at
    stages 0-1 only the embedding's, folded at the end). ``staging``: the two
    reduce-scatter staging buffers.
    """
    p = BYTES[w.params_dtype]
    g = BYTES[w.grads_dtype or w.params_dtype]
    block, root = w.model.block_parameters(w.tp), w.root_psi
    bucket = w.reduce_bucket_size
    gathered = grads = staging = 0
    if w.zero_stage == 3:
        gathered = w.psi * p if w.holds_stage else (root + 2 * block) * p
        grads = (root + block) * p
        staging = 2 * min(bucket, max(block, root)) * g
    elif w.zero_stage == 2:
        grads = 2 * min(bucket, w.psi) * p
        staging = 2 * min(bucket, w.psi) * g
    elif (w.grads_dtype or w.params_dtype) != w.params_dtype:
        grads = w.padded_vocab_size * w.model.hidden_size // w.tp * p
    return {"gathered": gathered, "grads": grads, "staging": staging,
            "total": gathered + grads + staging}


def peak_memory(w: Workload, runtime_bytes: int = 0) -> dict:
    """Predicted peak bytes per rank: ``runtime_bytes`` (the process before the
    model: framework, CUDA context or interpreter, data) + model states +
    activations + ZeRO buffers."""
    states = _states(w)
    acts = activation_bytes(w)
    bufs = buffer_bytes(w)
    total = runtime_bytes + states["total"] + acts["peak"] + bufs["total"]
    return {"runtime": runtime_bytes, "model_states": states["total"],
            "activations": acts["peak"], "buffers": bufs["total"], "total": total}


def _states(w: Workload) -> dict:
    """Model-state bytes of this rank: the dense parameters' over DP x CP, and an MoE
    model's experts (their ``1 / (ep x etp)``) over the expert DP group."""
    dense = model_state_bytes(w.psi - w.expert_psi, w.shard_ranks, w.zero_stage,
                              w.params_dtype, w.grads_dtype)
    if not w.expert_psi:
        return dense
    experts = model_state_bytes(w.expert_psi // (w.ep * w.etp), w.expert_shard_ranks,
                                w.zero_stage, w.params_dtype, w.grads_dtype)
    return {k: dense[k] + experts[k] for k in dense}


def expert_exchange_bytes(w: Workload) -> int:
    """Bytes this rank sends by all-to-all over the EP group per optimizer step, with
    routing uniform over the experts: each MoE layer sends each of its micro-batch's
    ``T k`` assignments' rows (C elements of the training dtype) that belong to another
    EP rank's experts, ``(EP - 1) / EP`` of them, four times (to the experts and back,
    in forward and in backward). 0 at EP 1. Under sequence parallelism a rank routes its
    ``1 / TP`` of the tokens; ETP's gather of each expert's rows is not counted."""
    if w.ep == 1 or w.model.moe is None:
        return 0
    moe_layers = sum(w.model.is_moe_layer(i) for i in w.layer_ids(w.stage))
    tokens = w.micro_batch_size * w.seq_per_rank // (w.tp if w.sequence_parallel else 1)
    rows = tokens * w.model.moe.moe_router_topk * (w.ep - 1) / w.ep
    per_layer = 4 * rows * w.model.hidden_size * BYTES[w.params_dtype]
    return int(per_layer * moe_layers * w.micro_batches)


def traffic_bytes(w: Workload) -> dict:
    """Bytes this rank sends over DP (x CP) per optimizer step (``comm_bytes_per_step``:
    ZeRO's, by kind, and their ``"total"``; an MoE model's experts over their DP group
    added, and ``"ep_bytes_per_step"``, their tokens' all-to-all, outside the total:
    :func:`expert_exchange_bytes`). With CP also ``"cp_bytes_per_step"``: the
    attention's K/V exchange and the loss's all-reduce over the CP group, by kind and
    ``"total"`` (:func:`hybrid.estimate.context_parallel.bytes_per_step`); the same for
    every ZeRO stage, so not in ``"total"``, which :func:`choose_stage` compares."""
    out = comm_bytes_per_step(w.psi - w.expert_psi, w.shard_ranks, w.zero_stage,
                              w.micro_batches, w.params_dtype, w.grads_dtype,
                              held=w.holds_stage)
    if w.expert_psi:  # the experts over their DP group, and the tokens' exchange
        experts = comm_bytes_per_step(w.expert_psi // (w.ep * w.etp), w.expert_shard_ranks,
                                      w.zero_stage, w.micro_batches, w.params_dtype,
                                      w.grads_dtype, held=w.holds_stage)
        out = {k: out[k] + experts[k] for k in out}
        out["ep_bytes_per_step"] = expert_exchange_bytes(w)
    if w.cp > 1:
        out["cp_bytes_per_step"] = cp_terms.bytes_per_step(w)
    return out


def choose_stage(w: Workload, budget_bytes: float, runtime_bytes: int = 0) -> int | None:
    """The ZeRO stage with the least DP traffic per step whose predicted peak fits
    ``budget_bytes`` (ties go to the lower stage), or None when none fits."""
    fitting = [s for s in range(4)
               if peak_memory(w.with_stage(s), runtime_bytes)["total"] <= budget_bytes]
    if not fitting:
        return None
    return min(fitting, key=lambda s: (traffic_bytes(w.with_stage(s))["total"], s))
