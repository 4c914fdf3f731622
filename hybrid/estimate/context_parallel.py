"""Context parallelism's share of a rank's activations and traffic, torch-free.

With ``C`` CP ranks each holds ``s = T / C`` tokens of every sequence, so every
activation term of :mod:`hybrid.estimate.memory` is taken at ``s`` instead of
``T``; this module adds what the CP attention (:mod:`hybrid.tensor_parallel.cp_attention`)
keeps and moves on top of that. ``w`` is a :class:`hybrid.estimate.workload.Workload`
with ``cp > 1``; per TP rank ``nh = a / t`` query heads and ``ng`` K/V heads of
``hs`` channels, ``e`` bytes per activation element.

[Note: what the CP attention saves]
``p2p`` and ``all_gather`` (blockwise, recomputing scores in backward, like flash
attention) save q, k, v (the QKV term, as before), their fp32 output ``(B, nh, s, hs)``
and fp32 log-sum-exp ``(B, nh, s)``: ``4 sbh / t + 4 nh s b`` -- no ``s x s`` scores,
with or without attention dropout (its mask is a hash of positions, recomputed).
The output is a tensor of its own here (the projection's input is a copy in
``(B, s, nh hs)`` order), where SDPA's output at CP 1 is the projection's input.
``a2a`` (Ulysses) saves the all-to-all'd q, k, v ``(B, nh / C, T, hs)`` (the QKV
term's bytes; QKV itself is freed), SDPA's output (``e`` bytes; fp32 through the
blockwise kernel when attention dropout is on) and log-sum-exp over the whole
``T`` for ``nh / C`` heads (``4 nh s b`` again), and the two int64 index vectors
that put the gathered sequence in position order and back: ``16 T`` bytes, the
only term that does not shrink with ``C``. Everything else is proportional to
``s``. (Measured on CPU with torch's default SDPA choice, which picks the flash
kernel: no T x T probabilities are saved. ``--attention-backend unfused`` would
keep them; this estimate assumes ``auto``, as :mod:`hybrid.estimate.memory` does.)

[Note: the CP attention's working set]
Beside what is saved, one layer's CP attention in backward holds its blocks'
fp32 ``(B, nh, lq, lk)`` matrices -- ``s/2 x s/2`` load-balanced (two or
three blocks per source), ``s x s`` striped (one per source), and for a2a with
attention dropout one causal ``T x T`` block of ``nh / C`` heads. A block alone
peaks at four: P, dP and the two temporaries of ``dS = P (dP - delta)`` (16 bytes
a pair); with several blocks per call the last one's P, dP and dS are still held
while the next one's scores are made (20 bytes). With dropout the mask's hash
holds three int64 temporaries beside P and dP (32 bytes; 40 with the last
block's P, dP, dS and mask). Then the exchange's buffers: fp32 ``dQ``, ``dK`` and
``dV`` at query-head width (``3 sbh 4 / t``); for ``p2p`` the [K; V] in use and
the one arriving (one at C = 2, where the last step receives nothing) and the
fp32 [dK; dV] in flight and arriving (``2 KV 4``); for ``all_gather`` the whole
sequence's [K; V] (``C KV e``) and its fp32 gradients (``C KV 4``); with a
16-bit dtype fp32 copies of q and dOut, and K, V expanded to fp32 at query-head
width (also with GQA). a2a without dropout runs SDPA's fused kernel: its dQ,
dK, dV, the index gather's gradient and one all-to-all's send, receive and
re-laid buffers, ``7 sbh e / t``. None of this is saved for backward, so the
activation meter does not see it; ``tests/estimate/test_cp_activations.py``
checks it against the allocator's high-water mark. It is the transient that
competes with the logits at the peak, and for long sequences the largest:
``20 b nh T^2 / (4 C^2)`` bytes load-balanced.

[Note: CP traffic]
Bytes a rank sends per layer per micro-batch, forward + backward, counted as the
comm door counts them (:mod:`hybrid.parallel.comm`), with ``KV = 2 B ng s hs``
elements of one [K; V] block and ``f = (C - 1) / C``:

    p2p:        forward (C-1) KV e;  backward (C-1) KV e + C KV 4  (fp32 dK/dV)   [p2p]
    all_gather: forward (C-1) KV e;  backward (C-1) KV e            [all_gather]
                                     + (C-1) KV 4                   [reduce_scatter]
    a2a:        forward q, k, v, out  (2 B nh s hs + 2 B ng s hs) e f;
                backward the same four again                         [all_to_all]

A recomputed layer (full recompute, or selective: the attention core is what
reruns) runs its forward exchange again in backward. Each micro-batch also
all-reduces the loss over CP: one fp32 scalar, two with a loss mask.
"""

from __future__ import annotations

from hybrid.config.sections import CP_COMM_TYPES
from hybrid.estimate.model_states import BYTES
from hybrid.estimate.workload import Workload


def _shape(w: Workload) -> tuple[int, int, int, int, int, int]:
    """(b, s, nh, ng, hs, e): this rank's micro-batch, tokens, query and K/V heads per
    TP rank, head size, activation bytes."""
    m = w.model
    return (w.micro_batch_size, m.seq_length // w.cp, m.num_attention_heads // w.tp,
            m.query_groups // w.tp, m.head_size, BYTES[w.params_dtype])


def _check(w: Workload) -> None:
    if w.cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {w.cp_comm_type!r}")


def attention_saved_bytes(w: Workload) -> int:
    """Bytes one layer's CP attention saves beyond q, k, v (see [Note: what the CP
    attention saves]): output, log-sum-exp, and a2a's two index vectors."""
    _check(w)
    b, s, nh, _, hs, e = _shape(w)
    lse = 4 * nh * s * b
    if w.cp_comm_type != "a2a":
        return 4 * b * nh * s * hs + lse
    out = (4 if w.model.attention_dropout > 0 else e) * b * nh * s * hs
    return out + lse + 2 * 8 * w.model.seq_length


def attention_working_set(w: Workload) -> int:
    """Transient bytes of one layer's CP attention in backward (see [Note: the CP
    attention's working set])."""
    _check(w)
    b, s, nh, ng, hs, e = _shape(w)
    q4, kv = 4 * b * nh * s * hs, 2 * b * ng * s * hs
    dropout = w.model.attention_dropout > 0
    if w.cp_comm_type == "a2a" and not dropout:
        return 7 * b * nh * s * hs * e  # SDPA's fused kernel: no blocks
    # bytes per (query, key) pair of a block: one block per call (striped, a2a): P,
    # dP and dS's two temporaries (fp32), with dropout P and dP beside the mask
    # hash's three int64; several (load-balanced): the last block's P, dP, dS (and
    # mask) still held while the next one's scores are made
    several = w.cp_comm_type != "a2a" and w.cp_layout == "load_balanced"
    per_pair = (40 if several else 32) if dropout else (20 if several else 16)
    # dQ, dK, dV in fp32 at query-head width; fp32 copies of q and dOut, and K, V
    # expanded to query-head width, unless they are views already
    buffers = 3 * q4 + (2 * q4 if e != 4 else 0) + (2 * q4 if e != 4 or nh != ng else 0)
    if w.cp_comm_type == "a2a":  # one causal block of the whole sequence, nh / C heads
        T = w.model.seq_length
        return per_pair * b * (nh // w.cp) * T * T + buffers
    side = s // 2 if w.cp_layout == "load_balanced" else s
    if w.cp_comm_type == "p2p":
        # [K; V] in use and arriving (the last step: only in use), fp32 [dK; dV]
        # in flight and arriving
        buffers += (2 if w.cp > 2 else 1) * kv * e + 2 * kv * 4
    else:  # the whole sequence's [K; V] and its fp32 gradients
        buffers += w.cp * kv * (e + 4)
    return per_pair * b * nh * side * side + buffers


def bytes_per_layer(w: Workload) -> dict:
    """{kind: bytes} one layer sends over CP per micro-batch, forward and backward
    (see [Note: CP traffic]); ``"forward"``: the part a recompute runs again."""
    _check(w)
    b, s, nh, ng, hs, e = _shape(w)
    C = w.cp
    kv = 2 * b * ng * s * hs
    if w.cp_comm_type == "p2p":
        fwd = (C - 1) * kv * e
        return {"p2p": 2 * fwd + C * kv * 4, "forward": {"p2p": fwd}}
    if w.cp_comm_type == "all_gather":
        fwd = (C - 1) * kv * e
        return {"all_gather": 2 * fwd, "reduce_scatter": (C - 1) * kv * 4,
                "forward": {"all_gather": fwd}}
    fwd = (C - 1) * (2 * b * nh * s * hs + 2 * b * ng * s * hs) * e // C
    return {"all_to_all": 2 * fwd, "forward": {"all_to_all": fwd}}


def bytes_per_step(w: Workload) -> dict:
    """{kind: bytes, "total"} this rank sends over CP per optimizer step: every layer
    of every micro-batch, recomputed layers' forward exchange again, and the loss's
    all-reduce (see [Note: CP traffic])."""
    layer = bytes_per_layer(w)
    layers = w.model.num_layers
    if w.selective_recompute:
        rerun = layers
    elif w.recompute:
        rerun = w.recompute_num_layers or layers
    else:
        rerun = 0
    out = dict.fromkeys(("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p"), 0)
    for kind in out:
        out[kind] = (layers * layer.get(kind, 0) + rerun * layer["forward"].get(kind, 0))
    scalars = 2 if w.loss_mask else 1  # [sum, count] with a loss mask
    out["all_reduce"] += round(2 * 4 * scalars * (w.cp - 1) / w.cp)
    out = {kind: v * w.micro_batches for kind, v in out.items()}
    out["total"] = sum(out.values())
    return out
