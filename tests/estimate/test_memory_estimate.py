"""The estimator's activation terms equal, byte for byte, what autograd saves.

A GPT is run forward under a saved-tensor hook that records every storage
autograd keeps for backward (parameters aside); one layer's bytes are the
difference between a 2-layer and a 1-layer model, the head's the rest. Checked
at TP 1 and 2, fp32 and bf16, with and without dropout, and under full
recompute (stored inputs only, whole or partitioned over TP) -- for GPT-2 and
for a Llama-shaped model (RMSNorm, SwiGLU, RoPE, GQA, untied, no biases).
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hybrid.config.model import ModelConfig
from hybrid.config.sections import RecomputeConfig
from hybrid.estimate.memory import (
    Workload,
    activation_bytes,
    activation_bytes_per_layer,
    choose_stage,
    head_bytes,
    peak_memory,
    traffic_bytes,
)
from hybrid.parallel.state import ParallelState
from hybrid.recompute.checkpointing import apply_activation_checkpointing
from hybrid.tensor_parallel import full_shape, seed_all
from hybrid.train.setup import recompute_targets
from models.gpt import GPT
from tests.helpers.harness import run_ranks
from tests.helpers.launch import ROOT, env

S, B, H, HEADS, V = 16, 2, 32, 4, 256
CASES = [  # (dtype, hidden dropout, attention dropout)
    ("fp32", 0.0, 0.0), ("bf16", 0.0, 0.0), ("fp32", 0.1, 0.0), ("fp32", 0.1, 0.1),
    ("bf16", 0.1, 0.1)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# The Llama-shaped model's ModelConfig fields
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             num_query_groups=2, untie_embeddings_and_output_weights=True,
             add_bias_linear=False)
LLAMA_FFN = 48  # SwiGLU's [gate | up] is 96 wide


def _model(layers, drop, attn, arch=None):
    """The model both the estimator and the measured GPT take (V rows at TP 1 and 2)."""
    return ModelConfig(vocab_size=V, num_layers=layers, hidden_size=H, num_attention_heads=HEADS,
                       ffn_hidden_size=LLAMA_FFN if arch else 4 * H, seq_length=S,
                       max_position_embeddings=S, hidden_dropout=drop, attention_dropout=attn,
                       **(arch or {}))


def _workload(tp, dtype, drop, attn, layers=1, arch=None, **kw):
    return Workload(model=_model(layers, drop, attn, arch), micro_batch_size=B, tp=tp,
                    params_dtype=dtype, device="cpu", **kw)


def _saved_bytes(ps, layers, dtype, drop, attn, recompute=None, sp=False, arch=None):
    """Bytes of the distinct storages autograd saves in one forward (params excluded),
    plus the checkpoints activation checkpointing stores."""
    rng = seed_all(1, ps.tp_rank, ps.dp_rank, ps.device)
    model = GPT(_model(layers, drop, attn, arch), ps.tp_group, rng=rng, seed=1,
                sequence_parallel=sp).to(DTYPES[dtype])
    ac = None if recompute is None else apply_activation_checkpointing(
        model, ps, rng, recompute, blocks=recompute_targets(model, recompute))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, V, (B, S), generator=g) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels)  # held: the graph keeps the checkpoints alive
    stored = ac.stored_bytes() if ac is not None else 0
    del loss
    return sum(seen.values()) + stored


def _measure(ps):
    out = {}
    for case in CASES:
        one, two = (_saved_bytes(ps, n, *case) for n in (1, 2))
        out[case] = {"layer": two - one, "head": 2 * one - two}
        if ps.tp_size > 1:
            one, two = (_saved_bytes(ps, n, *case, sp=True) for n in (1, 2))
            out[("sp", *case)] = {"layer": two - one, "head": 2 * one - two}
    for case in CASES:  # selective: only the attention cores rerun
        rc = RecomputeConfig(granularity="selective")
        one, two = (_saved_bytes(ps, n, *case, rc) for n in (1, 2))
        out[("selective", *case)] = two - one
    for partition in (False, True):
        rc = RecomputeConfig(granularity="full", partition_activations=partition)
        one, two = (_saved_bytes(ps, n, "fp32", 0.0, 0.0, rc) for n in (1, 2))
        out[("recompute", partition)] = two - one
        # Megatron's uniform method, groups of 2: 3 layers store 2 inputs, 4 layers 2
        rc = RecomputeConfig(granularity="full", layers_per_checkpoint=2,
                             partition_activations=partition)
        for n in (3, 4):
            out[("uniform 2", partition, n)] = _saved_bytes(ps, n, "fp32", 0.0, 0.0, rc)
    for case in CASES:  # Llama-shaped: plain, SP, selective
        for sp in (False, True) if ps.tp_size > 1 else (False,):
            one, two = (_saved_bytes(ps, n, *case, sp=sp, arch=LLAMA) for n in (1, 2))
            out[("llama", sp, *case)] = {"layer": two - one, "head": 2 * one - two}
        rc = RecomputeConfig(granularity="selective")
        one, two = (_saved_bytes(ps, n, *case, rc, arch=LLAMA) for n in (1, 2))
        out[("llama-selective", *case)] = two - one
    return out


@pytest.fixture(scope="module")
def measured():
    """{tp: what rank 0 saw} at TP 1 (this process) and TP 2."""
    return {1: _measure(ParallelState.single()),
            2: run_ranks(_measure, world_size=2, tp=2)[0]}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-drop{c[1]}-attn{c[2]}")
def test_layer_activations_equal_saved_bytes(measured, tp, case):
    assert measured[tp][case]["layer"] == activation_bytes_per_layer(_workload(tp, *case))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-drop{c[1]}-attn{c[2]}")
def test_head_activations_equal_saved_bytes(measured, tp, case):
    assert measured[tp][case]["head"] == head_bytes(_workload(tp, *case))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-drop{c[1]}-attn{c[2]}")
def test_sequence_parallel_activations_equal_saved_bytes(measured, case):
    w = _workload(2, *case, sequence_parallel=True)
    got = measured[2][("sp", *case)]
    assert got["layer"] == activation_bytes_per_layer(w)
    assert got["head"] == head_bytes(w)
    if case[2] == 0.0:  # no CPU math-kernel scores: every stored term is 1/TP of TP=1's
        assert got["layer"] * 2 == measured[1][case]["layer"]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-drop{c[1]}-attn{c[2]}")
def test_selective_recompute_drops_the_attention_core(measured, tp, case):
    w = _workload(tp, *case, selective_recompute=True)
    assert measured[tp][("selective", *case)] == activation_bytes_per_layer(w)
    assert activation_bytes_per_layer(w) < measured[tp][case]["layer"]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("partition", [False, True])
def test_recomputed_layer_keeps_only_its_input(measured, tp, partition):
    w = _workload(tp, "fp32", 0.0, 0.0, layers=2, recompute=True,
                  partition_activations=partition)
    per_layer_stored = (activation_bytes(w)["layers"]) // 2
    assert measured[tp][("recompute", partition)] == per_layer_stored
    assert per_layer_stored == S * B * H * 4 // (tp if partition else 1)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-drop{c[1]}-attn{c[2]}")
def test_llama_activations_equal_saved_bytes(measured, tp, sp, case):
    """RMSNorm's one statistic, SwiGLU's 3f, the GQA-narrow QKV (split and rotated
    into fresh q, k, v by RoPE), no position ids: layer and head, with SP and with
    selective recompute."""
    w = _workload(tp, *case, arch=LLAMA, sequence_parallel=sp)
    got = measured[tp][("llama", sp, *case)]
    assert got["layer"] == activation_bytes_per_layer(w)
    assert got["head"] == head_bytes(w)
    if not sp:
        sel = replace(w, selective_recompute=True)
        assert measured[tp][("llama-selective", *case)] == activation_bytes_per_layer(sel)
    # a GPT-2 layer of this width saves more: 4f of MLP against 3 x 48, full-width K, V
    assert got["layer"] < measured[tp][("sp", *case) if sp else case]["layer"]


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2"])
def test_llama_parameter_count_matches_the_model(qkv_bias):
    """Psi is what one TP rank of the built model holds, at TP 1 and 2. Qwen2's QKV bias
    (--add-qkv-bias): (4 + 2 x 2) heads x 8 channels per layer more."""
    class RankZeroOf:  # a TP group's size and rank: all a model needs to be built on meta
        def __init__(self, size):
            self.size, self.rank = size, 0

    arch = dict(LLAMA, add_qkv_bias=qkv_bias)
    for tp in (1, 2):
        w = _workload(tp, "fp32", 0.0, 0.0, layers=2, arch=arch)
        model = GPT(w.model, RankZeroOf(tp), device="meta")
        assert w.psi == sum(p.numel() for p in model.parameters())
        base = _workload(tp, "fp32", 0.0, 0.0, layers=2, arch=LLAMA).psi
        assert w.psi - base == qkv_bias * 2 * (4 + 2 * 2) * 8 // tp
        whole = sum(math.prod(full_shape(p)) for p in model.parameters())
        assert w.model.num_parameters(tp, per_rank=False) == whole


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("partition", [False, True])
@pytest.mark.parametrize("layers", [3, 4])
def test_uniform_groups_keep_one_input_per_group(measured, tp, partition, layers):
    """Groups of 2 layers: the whole forward saves the head's activations and
    ceil(L / 2) stored inputs, nothing of the layers themselves; a group's
    backward holds 2 layers' activations."""
    w = _workload(tp, "fp32", 0.0, 0.0, layers=layers, recompute=True,
                  recompute_layers_per_checkpoint=2, partition_activations=partition)
    acts = activation_bytes(w)
    assert acts["layers"] == 2 * S * B * H * 4 // (tp if partition else 1)
    assert measured[tp][("uniform 2", partition, layers)] == acts["layers"] + head_bytes(w)
    assert acts["recompute_working_set"] == 2 * activation_bytes_per_layer(w)


def test_choose_stage_weighs_peak_against_traffic():
    # 8 micro-batches: stage 1 moves far less than 2-3, so it wins while it fits
    model = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16,
                        ffn_hidden_size=8192, seq_length=1024, max_position_embeddings=1024,
                        vocab_size=50257, make_vocab_size_divisible_by=32,  # 50304 rows at TP 4
                        hidden_dropout=0.0, attention_dropout=0.0)
    w = Workload(model=model, micro_batch_size=4, tp=4, dp=8, micro_batches=8,
                 params_dtype="bf16", grads_dtype="fp32", recompute=True)
    assert w.padded_vocab_size == 50304
    peaks = {s: peak_memory(w.with_stage(s))["total"] for s in range(4)}
    traffic = {s: traffic_bytes(w.with_stage(s))["total"] for s in range(4)}
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]
    assert traffic[1] < traffic[0] and traffic[1] < traffic[2] < traffic[3]
    assert choose_stage(w, budget_bytes=peaks[0]) == 1
    assert choose_stage(w, budget_bytes=peaks[1]) == 1
    assert choose_stage(w, budget_bytes=peaks[1] - 1) == 2
    assert choose_stage(w, budget_bytes=peaks[3]) == 3
    assert choose_stage(w, budget_bytes=peaks[3] - 1) is None
    # one micro-batch, bf16 gradients: stage 0's all-reduce moves what stage 1's
    # reduce-scatter + all-gather do, and the tie goes to the lower stage; fp32
    # gradients make the all-reduce 4/3 of that
    w1 = replace(w, micro_batches=1, grads_dtype="bf16")
    assert choose_stage(w1, budget_bytes=peak_memory(w1.with_stage(0))["total"]) == 0
    assert choose_stage(replace(w1, grads_dtype="fp32"), budget_bytes=peaks[0]) == 1


def test_estimate_memory_script_recommends_a_stage_and_rejects_bad_layouts():
    script = os.path.join(ROOT, "scripts", "estimate_memory.py")
    preset = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
              "--seq-length", "1024", "--tensor-model-parallel-size", "4",
              "--micro-batch-size", "4", "--global-batch-size", "512", "--bf16",
              "--tokenizer-type", "gpt2bpe", "--world-size", "32"]
    out = subprocess.run([sys.executable, script, *preset, "--gpu-memory-gb", "80"],
                         capture_output=True, text=True, check=True, env=env()).stdout
    records = [json.loads(line) for line in out.splitlines()]
    stages = records[:4]
    assert [r["zero_stage"] for r in stages] == [0, 1, 2, 3]
    assert all(r["dp"] == 8 and r["micro_batches"] == 16 and r["fits"] for r in stages)
    assert records[-1]["recommended_zero_stage"] == 1  # what examples/pretrain_gpt2.sh runs
    assert records[4]["offload"]["setting"] == "none"  # the run's own offload setting
    bad = subprocess.run([sys.executable, script, *preset[:-2], "--world-size", "6"],
                         capture_output=True, check=False, text=True, env=env())
    assert bad.returncode == 2
    assert "--tensor-model-parallel-size 4 does not divide the world size 6" in bad.stderr


def _presets():
    """{size: (flags of its shape, the flags every preset shares)} from
    examples/pretrain_gpt2.sh."""
    import re
    import shlex
    path = os.path.join(ROOT, "examples", "pretrain_gpt2.sh")
    text = Path(path).read_text(encoding="utf-8")
    shapes = {m[1]: shlex.split(m[2]) for m in
              re.finditer(r"^\s*([\w.]+)\) shape=\(([^)]*)\)", text, flags=re.M)}
    common = text[text.index('"${shape[@]}"') + len('"${shape[@]}"'):]
    keep = ("--seq-length", "--micro-batch-size", "--global-batch-size")
    words = shlex.split(common.replace("\\\n", " "))
    shared = ["--bf16"] + [x for i, w in enumerate(words) if w in keep
                           for x in (w, words[i + 1])]
    return shapes, shared


@pytest.mark.parametrize("world", [8, 32])
def test_gpt2_presets_run_the_stage_the_estimator_recommends(world):
    from hybrid.config import build_config, parse_args
    from hybrid.estimate.memory import workload
    shapes, shared = _presets()
    assert set(shapes) == {"125m", "350m", "1.3b"} and "--global-batch-size" in shared
    for size, shape in shapes.items():
        cfg = parse_args(shape + shared + ["--hidden-dropout", "0", "--attention-dropout", "0"])
        w = workload(build_config(cfg, world), 50257)
        assert choose_stage(w, budget_bytes=80 * 2 ** 30, runtime_bytes=int(1.5 * 2 ** 30)) \
            == cfg.zero_stage, size


def _metered(ps, recompute):
    """SavedActivationMeter's peak over one forward + backward of a 2-layer fp32 GPT."""
    from hybrid.train.activation_meter import SavedActivationMeter
    rng = seed_all(1, ps.tp_rank, ps.dp_rank, ps.device)
    model = GPT(_model(2, 0.0, 0.0), ps.tp_group, rng=rng, seed=1)
    ac = None if recompute is None else apply_activation_checkpointing(
        model, ps, rng, recompute, blocks=recompute_targets(model, recompute))
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, V, (B, S), generator=g) for _ in range(2))
    meter = SavedActivationMeter(extra=ac.stored_bytes if ac else lambda: 0)
    with meter:
        model(tokens, labels).backward()
    return meter.peak


def test_activation_meter_peaks_at_what_forward_saved():
    ps = ParallelState.single()
    w = _workload(1, "fp32", 0.0, 0.0, layers=2)
    # no recompute: the peak is everything forward saved, at the start of backward
    assert _metered(ps, None) == 2 * activation_bytes_per_layer(w) + head_bytes(w)
    # selective: the attention cores' scores never pile up across layers
    sel = _metered(ps, RecomputeConfig(granularity="selective"))
    assert sel == 2 * activation_bytes_per_layer(replace(w, selective_recompute=True)) \
        + head_bytes(w)
    # full: two stored inputs and the head at the end of forward; in backward, one
    # block's activations again beside block 0's input and the ids the embeddings keep
    full = _metered(ps, RecomputeConfig(granularity="full"))
    stored, ids = S * B * H * 4, 8 * S * B + 8 * S
    assert full == max(2 * stored + head_bytes(w),
                       stored + activation_bytes_per_layer(w) + ids)


def test_estimate_memory_script_reports_context_parallel_traffic():
    """--context-parallel-size 2 on 4 ranks: DP 2, ZeRO shards over DP x CP (4), each
    rank's activations are those of T / 2 tokens, and every stage's record carries the
    CP K/V traffic per step (the same for every stage); the text report names it."""
    from hybrid.config import build_config, parse_args
    from hybrid.estimate.memory import workload
    script = os.path.join(ROOT, "scripts", "estimate_memory.py")
    shape = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
             "--seq-length", "2048", "--max-position-embeddings", "2048",
             "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
             "--context-parallel-size", "2", "--world-size", "4"]
    out = subprocess.run([sys.executable, script, *shape], capture_output=True, text=True,
                         check=True, env=env()).stdout
    stages = [json.loads(line) for line in out.splitlines()][:4]
    cfg = build_config(parse_args(shape[:-2]), 4)
    w = workload(cfg, 257)
    assert (w.cp, w.dp, w.shard_ranks, w.seq_per_rank) == (2, 2, 4, 1024)
    # 1 micro-batch x DP 2 of 8 sequences: 4 micro-batches per step
    want_cp = traffic_bytes(replace(w, micro_batches=4))["cp_bytes_per_step"]
    for r in stages:
        assert (r["cp"], r["dp"], r["seq_per_rank"], r["micro_batches"]) == (2, 2, 1024, 4)
        assert r["traffic_bytes_per_step"]["cp_bytes_per_step"] == want_cp
        assert r["model_states"]["optimizer"] == (12 * w.psi // 4 if r["zero_stage"] else
                                                  12 * w.psi)
    # ring: 4 layers x 4 micro-batches x (2 (C - 1) KV e + C KV 4), KV = 2 b heads s hs
    kv = 2 * 1 * 8 * 1024 * 32
    assert want_cp["p2p"] == 4 * 4 * (2 * kv * 2 + 2 * kv * 4)
    assert want_cp["all_reduce"] == 4 * 4  # the loss, 2 x 4 bytes x 1/2, per micro-batch
    half = replace(w, cp=1, model=replace(w.model, seq_length=1024))
    # a CP 2 layer is a CP 1 layer of T / 2 tokens and the attention's own fp32 output
    assert activation_bytes_per_layer(w) == activation_bytes_per_layer(half) + 4 * 1024 * 256
    text = subprocess.run([sys.executable, script, *shape, "--format", "text"],
                          capture_output=True, text=True, check=True, env=env()).stdout
    assert "CP 2 (p2p, load_balanced): 1,024 tokens of each sequence per rank" in text


# Qwen3-shaped: heads 16 wide (--kv-channels; 4 x 16 = 64 against the hidden 32), their
# q and k normalized (--qk-layernorm)
QWEN3 = dict(LLAMA, kv_channels=16, qk_layernorm=True)


def test_qwen3_activations_and_parameters_follow_the_head_width():
    """At TP 1 (one process): a layer saves what the estimator counts -- the wider QKV
    and attention output, the QKV output the q and k norms keep and their statistics --
    plain and with selective recompute; Psi is the built model's at TP 1 and 2."""
    ps = ParallelState.single()
    rc = RecomputeConfig(granularity="selective")
    for case in CASES:
        w = _workload(1, *case, arch=QWEN3)
        one, two = (_saved_bytes(ps, n, *case, arch=QWEN3) for n in (1, 2))
        assert two - one == activation_bytes_per_layer(w), case
        one, two = (_saved_bytes(ps, n, *case, rc, arch=QWEN3) for n in (1, 2))
        assert two - one == activation_bytes_per_layer(replace(w, selective_recompute=True))

    class RankZeroOf:  # a TP group's size and rank: all a model needs to be built on meta
        def __init__(self, size):
            self.size, self.rank = size, 0

    for tp in (1, 2):
        w = _workload(tp, "fp32", 0.0, 0.0, layers=2, arch=QWEN3)
        model = GPT(w.model, RankZeroOf(tp), device="meta")
        assert w.psi == sum(p.numel() for p in model.parameters())
        whole = sum(math.prod(full_shape(p)) for p in model.parameters())
        assert w.model.num_parameters(tp, per_rank=False) == whole
