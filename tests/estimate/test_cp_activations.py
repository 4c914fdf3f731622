"""Context parallelism's activations and traffic, measured against the estimator.

A 2-layer fp32 GPT (hidden 64, 4 heads, T = 64, B = 2, vocabulary 256) runs one
micro-batch at CP 1 (this process) and at CP 2 and CP 4 (world 4 in the test pool:
at CP 2 two DP replicas do the same work), each CP rank fed its T / C tokens.
:class:`SavedActivationMeter` measures what autograd keeps: one layer's bytes are
the 2-layer model's minus the 1-layer model's at the end of forward, the head's
the rest. What they show:

* every term a layer saves is proportional to the tokens a rank holds, s = T / C
  (norm inputs and outputs and statistics, QKV, the projection's input, the MLP,
  and the CP attention's fp32 output and log-sum-exp), except a2a's two int64
  index vectors over the whole sequence (16 T bytes). The CP attention's output
  has bytes of its own (4 s b h), where at CP 1 SDPA's output is the projection's
  input; so C x (layer at CP C - fixed) is CP 1's layer + 4 T b h, exactly;
* the head (ids, positions, final norm, softmax) is proportional to s but for the
  loss's fp32 scalar (4 bytes);
* :func:`activation_bytes_per_layer` and :func:`head_bytes` give those bytes exactly,
  and the meter's peak is the end of forward's (2 layers + head);
* the comm door's byte counts are :func:`traffic_bytes`'s ``cp_bytes_per_step``, by
  kind, with and without full recompute (which runs the forward exchange again);
* one CP attention call's backward allocates what
  :func:`hybrid.estimate.context_parallel.attention_working_set` says (the
  allocator's high-water mark, read from the profiler), at CP 2 and 4, for each
  comm type and layout, fp32 and bf16 with GQA, with and without dropout.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from hybrid.config.model import ModelConfig
from hybrid.config.sections import RecomputeConfig
from hybrid.estimate.context_parallel import attention_working_set
from hybrid.estimate.memory import (
    Workload,
    activation_bytes,
    activation_bytes_per_layer,
    head_bytes,
    traffic_bytes,
)
from hybrid.parallel.state import ParallelState
from hybrid.recompute.checkpointing import apply_activation_checkpointing
from hybrid.tensor_parallel import seed_all
from hybrid.tensor_parallel.context_parallel import cp_shard
from hybrid.tensor_parallel.cp_attention import ContextParallel
from hybrid.train.activation_meter import SavedActivationMeter
from hybrid.train.setup import recompute_targets
from models.gpt import GPT
from tests.helpers.harness import run_ranks

T, B, H, NH, V = 64, 2, 64, 4, 256
COMMS = ("p2p", "all_gather", "a2a")
LOSS_SCALAR = 4  # the loss's fp32 scalar the head keeps whole at any CP size
# one CP attention call: (CP, comm, layout, K/V heads, dtype, attention dropout, T)
WORKING_SET_CASES = [(2, "p2p", "load_balanced", NH, "fp32", 0.0, 512),
                     (4, "p2p", "load_balanced", NH, "fp32", 0.0, 512),
                     (2, "p2p", "striped", 2, "bf16", 0.0, 512),
                     (2, "p2p", "load_balanced", NH, "fp32", 0.1, 512),
                     (2, "all_gather", "load_balanced", NH, "fp32", 0.0, 512),
                     (4, "all_gather", "striped", 2, "bf16", 0.0, 512),
                     (2, "a2a", "load_balanced", NH, "fp32", 0.0, 512),
                     (2, "a2a", "load_balanced", NH, "fp32", 0.1, 256)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model(layers, seq=T, heads=NH, groups=None, attn=0.0):
    return ModelConfig(vocab_size=V, num_layers=layers, hidden_size=H, num_attention_heads=heads,
                       num_query_groups=groups, ffn_hidden_size=4 * H, seq_length=seq,
                       max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=attn)


def _workload(cp, comm="p2p", layers=1, **kw):
    return Workload(model=_model(layers), micro_batch_size=B, device="cpu", cp=cp,
                    cp_comm_type=comm, **kw)


def _run(ps, layers, comm, recompute=None):
    """(bytes saved at the end of forward, the meter's peak, CP bytes moved by kind) of
    one micro-batch through a ``layers``-layer GPT on this rank's tokens."""
    rng = seed_all(1, ps.tp_rank, ps.dp_rank, ps.device)
    cp = ContextParallel(ps.cp_group, comm) if ps.cp_size > 1 else None
    model = GPT(_model(layers), ps.tp_group, rng=rng, seed=1, context_parallel=cp)
    ac = None if recompute is None else apply_activation_checkpointing(
        model, ps, rng, recompute, blocks=recompute_targets(model, recompute))
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, V, (B, T), generator=g) for _ in range(2))
    if cp is not None:
        tokens, labels = (cp_shard(x, 1, ps.cp_size, ps.cp_rank) for x in (tokens, labels))
    ps.comm_stats.reset()
    meter = SavedActivationMeter(extra=ac.stored_bytes if ac else lambda: 0)
    with meter:
        loss = model(tokens, labels)
        held = meter.held()
        loss.backward()
    return held, meter.peak, ps.comm_stats.snapshot()


def _attention_backward_peak(ps, comm, layout, groups, dtype, dropout, seq):
    """The CPU allocator's high-water mark during one CP attention call's backward,
    ``(B, NH, seq / C, 16)`` queries, above where backward started. Every tensor is made
    inside the profiled region, so the profiler sees each allocation and free in order."""
    def call():
        g = torch.Generator().manual_seed(0)
        s, dt = seq // ps.cp_size, DTYPES[dtype]
        q = torch.randn(B, NH, s, 16, generator=g).to(dt).requires_grad_()
        k, v = (torch.randn(B, groups, s, 16, generator=g).to(dt).requires_grad_()
                for _ in range(2))
        dy = torch.randn(B, NH, s, 16, generator=g).to(dt)
        torch.manual_seed(11)  # the dropout seed: the same on every rank
        y = ContextParallel(ps.cp_group, comm, layout).attention(q, k, v, dropout_p=dropout)
        with record_function("cp_backward"):
            y.backward(dy)

    # A gloo thread sometimes frees a gather's staging buffer late, which only raises
    # the mark: the least of three calls is the working set.
    return min(_profiled_peak(call) for _ in range(3))


def _profiled_peak(call) -> int:
    """The allocator's high-water mark inside ``call``'s "cp_backward" region, above
    where that region began."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == "cp_backward")
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    now = start = peak = 0
    for e in memory:
        if e.start_ns() > mark.end_ns():
            break
        now += e.nbytes()
        if e.start_ns() < mark.start_ns():
            start = peak = now
        peak = max(peak, now)
    return peak - start


def _measure(ps):
    out = {}
    for comm in COMMS if ps.cp_size > 1 else ("p2p",):
        (one, _, _), (two, peak, moved) = (_run(ps, n, comm) for n in (1, 2))
        out[comm] = {"layer": two - one, "head": 2 * one - two, "peak": peak, "moved": moved}
    held, _, moved = _run(ps, 2, "p2p", RecomputeConfig(granularity="full"))
    out["recompute"] = {"held": held, "moved": moved}
    if ps.cp_size > 1:
        out["working_set"] = {c: _attention_backward_peak(ps, *c[1:]) for c in WORKING_SET_CASES
                              if c[0] == ps.cp_size}
    return out


@pytest.fixture(scope="module")
def measured():
    """{C: what rank 0 saw} at CP 1 (this process), 2 and 4 (world 4)."""
    one = _measure(ParallelState.single())
    return {1: {comm: one["p2p"] for comm in COMMS} | {"recompute": one["recompute"]},
            **{cp: run_ranks(_measure, world_size=4, cp=cp)[0] for cp in (2, 4)}}


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("comm", COMMS)
def test_cp_layer_and_head_bytes_equal_the_estimate(measured, comm, cp):
    """Byte for byte: a layer, the head, and the meter's peak (all of forward's saves,
    at the start of backward) at T / C tokens per rank."""
    w = _workload(cp, comm)
    got = measured[cp][comm]
    assert got["layer"] == activation_bytes_per_layer(w)
    assert got["head"] == head_bytes(w)
    assert got["peak"] == 2 * got["layer"] + got["head"]


@pytest.mark.parametrize("comm", COMMS)
def test_sequence_proportional_bytes_are_one_cp_th(measured, comm):
    """Layer = P / C + F, head = P' / C + 4: P (the sequence-proportional bytes of a
    layer: CP 1's, plus the CP attention's own fp32 output, 4 T b h) and P' (the
    head's) are the same at every C, F is a2a's 16 T of index vectors (0 otherwise)."""
    fixed = 2 * 8 * T if comm == "a2a" else 0
    out_fp32 = 4 * T * B * H
    layer1, head1 = measured[1][comm]["layer"], measured[1][comm]["head"]
    for cp in (2, 4):
        got = measured[cp][comm]
        assert (got["layer"] - fixed) * cp == layer1 + out_fp32
        assert (got["head"] - LOSS_SCALAR) * cp == head1 - LOSS_SCALAR
    # so the whole layer shrinks by C, less a2a's fixed term
    assert measured[4][comm]["layer"] - fixed == (measured[2][comm]["layer"] - fixed) // 2


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", COMMS)
def test_cp_traffic_equals_what_the_comm_door_counted(measured, comm, cp):
    """Two layers' K/V exchange forward and backward and the loss's all-reduce, by kind."""
    want = traffic_bytes(_workload(cp, comm, layers=2))["cp_bytes_per_step"]
    moved = measured[cp][comm]["moved"]
    assert moved == {kind: want.get(kind, 0) for kind in moved}
    assert want["total"] == sum(moved.values()) > 0


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_full_recompute_under_cp_stores_its_tokens_and_reruns_the_exchange(measured, cp):
    """Each checkpointed layer keeps only its (B, T / C, h) input; its backward runs the
    forward's K/V exchange again."""
    w = _workload(cp, layers=2, recompute=True)
    got = measured[cp]["recompute"]
    assert got["held"] == activation_bytes(w)["layers"] + head_bytes(w)
    assert activation_bytes(w)["layers"] == 2 * (T // cp) * B * H * 4
    if cp > 1:
        want = traffic_bytes(w)["cp_bytes_per_step"]
        assert got["moved"]["p2p"] == want["p2p"]
        plain = traffic_bytes(_workload(cp, layers=2))["cp_bytes_per_step"]["p2p"]
        kv = 2 * B * NH * (T // cp) * (H // NH) * 4
        assert want["p2p"] - plain == 2 * (cp - 1) * kv  # one forward exchange per layer


@pytest.mark.parametrize("case", WORKING_SET_CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_cp_attention_working_set_is_the_allocator_peak(measured, case):
    """One attention call's backward: its blocks and buffers (the estimate) are what
    the allocator held at most above where backward began, to 1% in our runs (the rest:
    lse- and delta-sized tensors; the least of three calls, see _attention_backward_peak)."""
    cp, comm, layout, groups, dtype, dropout, seq = case
    w = Workload(model=_model(1, seq, groups=groups, attn=dropout), micro_batch_size=B,
                 params_dtype=dtype, device="cpu", cp=cp, cp_comm_type=comm, cp_layout=layout)
    got = measured[cp]["working_set"][case]
    assert 0.9 * got <= attention_working_set(w) <= 1.03 * got
