"""bf16/fp16 matmuls on a CPU without native support: computed in fp32, rounded once,
with what F.linear saves; the choice follows the CPU's flags; one start-up warning.

The CPU's flags are faked (``cpu_features.cpu_flags``), so every case runs on any
machine; the fp32 path is also forced with ``configure`` as --kernel-choice does.
"""

import importlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hybrid import kernels
from hybrid.config import build_config, parse_kernel_choice
from hybrid.kernels import cpu_features, kernel_choice, linear, matmul, select
from tests.helpers.harness import run_ranks

CPU, LOW = torch.device("cpu"), (torch.bfloat16, torch.float16)


@pytest.fixture
def choose():
    before = kernels.current()
    yield lambda text: kernels.configure(replace(before, choice=parse_kernel_choice(text, "t")))
    kernels.configure(before)


@pytest.fixture
def flags(monkeypatch):
    """``flags({...})``: pretend this CPU reports those instruction-set flags."""
    def fake(names):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(names))
    return fake


@pytest.mark.parametrize("cpu,want", [
    ((), {torch.bfloat16: "fp32", torch.float16: "fp32"}),  # e.g. an AVX2-only CPU
    (("avx2", "avx512f", "avx512_bf16"), {torch.bfloat16: "eager", torch.float16: "fp32"}),
    (("amx_bf16", "amx_fp16"), {torch.bfloat16: "eager", torch.float16: "eager"}),
    (("bf16", "asimdhp"), {torch.bfloat16: "eager", torch.float16: "eager"}),  # Arm
])
def test_linear_path_follows_the_cpu_flags(flags, choose, cpu, want):
    flags(cpu)
    for dtype in LOW:
        assert kernel_choice("linear", CPU, dtype) == want[dtype]
    assert kernel_choice("linear", CPU, torch.float32) == "eager"
    assert kernel_choice("linear", torch.device("cuda"), torch.bfloat16) == "eager"
    choose("linear=eager")  # --kernel-choice wins over the flags, either way
    assert kernel_choice("linear", CPU, torch.bfloat16) == "eager"
    choose("linear=fp32")
    assert kernel_choice("linear", CPU, torch.bfloat16) == "fp32"
    assert kernel_choice("linear", CPU, torch.float32) == "eager"  # fp32 has nothing to route


def _case(dtype, bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 40, generator=g).to(dtype)
    w = (torch.randn(24, 40, generator=g) * 0.2).to(dtype)
    b = torch.randn(24, generator=g).to(dtype) if bias else None
    dy = torch.randn(3, 5, 24, generator=g).to(dtype)
    return x, w, b, dy


def _run(fn, x, w, b, dy):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = None if b is None else b.clone().requires_grad_()
    y = fn(xs, ws, bs)
    y.backward(dy)
    return y, xs.grad, ws.grad, None if b is None else bs.grad


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_path_is_the_fp32_product_rounded_once(choose, dtype, bias):
    """Forward and every gradient equal the fp32 computation on the same (exactly
    upcast) values, rounded to the dtype once; and agree with torch's own low-precision
    linear to that dtype's rounding."""
    x, w, b, dy = _case(dtype, bias)
    choose("linear=fp32")
    y, dx, dw, db = _run(linear, x, w, b, dy)
    f, d = x.float(), dy.float().reshape(-1, 24)
    assert y.dtype == dtype
    assert torch.equal(y, F.linear(f, w.float(), None if b is None else b.float()).to(dtype))
    assert torch.equal(dx, (dy.float() @ w.float()).to(dtype))
    assert torch.equal(dw, (d.t() @ f.reshape(-1, 40)).to(dtype))
    if bias:
        assert torch.equal(db, d.sum(0).to(dtype))
    torch_path = _run(F.linear, x, w, b, dy)
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    for a, ref in zip((y, dx, dw, db), torch_path):
        if ref is not None:
            torch.testing.assert_close(a.float(), ref.float(), rtol=tol, atol=tol)
    # matmul, for hand-written backwards: the same product, rounded once
    assert torch.equal(matmul(dy, w), (dy.float() @ w.float()).to(dtype))
    choose("linear=eager")
    assert torch.equal(matmul(dy, w), dy @ w)


def test_fp32_path_saves_what_f_linear_saves(choose):
    """Activation memory is unchanged: the same storages, of the same bytes, are held
    for backward as F.linear holds (the fp32 copies die inside the call)."""
    x, w, b, _ = _case(torch.bfloat16)
    w.requires_grad_()
    held = {}
    for path in ("eager", "fp32"):
        choose(f"linear={path}")
        seen = {}

        def pack(t, seen=seen):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        xs = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = linear(xs, w, b)
        held[path] = {n for p, n in seen.items() if p != w.untyped_storage().data_ptr()}
        assert w.untyped_storage().data_ptr() in seen  # the weight itself, no copy
        del y
    assert held["fp32"] == held["eager"] == {x.numel() * 2}


def _gpt_grads(ps, path, sp=False):
    """A bf16 GPT's loss, its gradients, and the fp32-path linears in its graph."""
    from hybrid.config.model import ModelConfig
    from hybrid.tensor_parallel import seed_all
    from models.gpt import GPT
    klinear = importlib.import_module("hybrid.kernels.linear")  # (the module, not the function)
    before, forward = kernels.current(), klinear._Fp32Linear.forward
    calls = []  # fp32-path forwards, graph nodes of their own or inside another Function
    klinear._Fp32Linear.forward = staticmethod(lambda ctx, *a: calls.append(1) or forward(ctx, *a))
    kernels.configure(replace(before, choice=(("linear", path),)))
    try:
        rng = seed_all(3, ps.tp_rank, ps.dp_rank, ps.device)
        cfg = ModelConfig(vocab_size=257, make_vocab_size_divisible_by=512 // ps.tp_size,
                          num_layers=2, hidden_size=32, num_attention_heads=4,  # 512 rows
                          max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
        model = GPT(cfg, ps.tp_group, rng=rng, seed=3, sequence_parallel=sp).to(torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 257, (2, 17), generator=g)
        loss = model(x[:, :-1], x[:, 1:])
        nodes, seen, todo = {}, set(), [loss.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            kind = type(fn).__name__
            nodes[kind] = nodes.get(kind, 0) + 1
            todo.extend(f for f, _ in fn.next_functions)
        loss.backward()
        return {"loss": loss.float().item(), "nodes": nodes, "fp32_forwards": len(calls),
                "grads": {n: p.grad.float().clone() for n, p in model.named_parameters()}}
    finally:
        kernels.configure(before)
        klinear._Fp32Linear.forward = forward


def _both_paths(ps, sp):
    return {path: _gpt_grads(ps, path, sp) for path in ("eager", "fp32")}


def _assert_paths_agree(res, linears, gathered=0, rows=0):
    """``linears``: fp32-path nodes of their own; ``gathered`` / ``rows``: sequence-gathered
    / cut-vocabulary head Functions calling ``linear`` inside. All 2 * 4 + 1 take the path."""
    eager, fp32 = res["eager"], res["fp32"]
    assert "_Fp32LinearBackward" not in eager["nodes"] and eager["fp32_forwards"] == 0
    assert fp32["nodes"].get("_Fp32LinearBackward") == linears
    assert fp32["fp32_forwards"] == 2 * 4 + 1
    for r in (eager, fp32):
        assert r["nodes"].get("_SequenceGatheredLinearBackward", 0) == gathered
        assert r["nodes"].get("_ColumnParallelLinearBackward", 0) == rows
    assert abs(fp32["loss"] - eager["loss"]) <= 1e-2 * abs(eager["loss"])
    for name, g in eager["grads"].items():
        rel = float((fp32["grads"][name] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel <= 3e-2, (name, rel)


def test_gpt_in_bf16_takes_the_fp32_path_everywhere():
    """Every linear of the GPT -- QKV, attention out, MLP in and out per layer, and the
    tied head (over the 257 real rows of 512) -- runs the fp32 path when chosen, and the
    model's loss and gradients agree with torch's own bf16 path to bf16's rounding."""
    from hybrid.parallel.state import ParallelState
    _assert_paths_agree(_both_paths(ParallelState.single(), False), linears=2 * 4, rows=1)


def test_sequence_parallel_linears_take_the_fp32_path():
    """Under SP at TP 2 the row-parallel linears are fp32-path nodes of their own; the
    column-parallel ones and the head run inside the sequence-gathered Function, whose
    forward calls ``linear`` and whose hand-written backward calls ``matmul`` (both
    exact above); the loss and gradients agree with torch's bf16 path."""
    for rank in run_ranks(_both_paths, world_size=2, tp=2, args=(True,)):
        _assert_paths_agree(rank, linears=2 * 2, gathered=2 * 2 + 1)


def test_warning_names_the_flags_the_slowdown_and_fp32(flags, choose):
    flags(("avx2", "avx512f"))
    msg = select.low_precision_warning("bf16", CPU)
    assert "--bf16 on a CPU without native bf16" in msg and "amx_bf16 or avx512_bf16" in msg
    assert f"{cpu_features.SLOWDOWN_TORCH_MATMUL}x" in msg and "fp32" in msg
    assert "drop --bf16" in msg
    assert "avx512_fp16" in select.low_precision_warning("fp16", CPU)
    choose("linear=eager")  # told to use torch's path: the warning says what that costs
    assert "--kernel-choice linear=eager" in select.low_precision_warning("bf16", CPU)
    assert select.low_precision_warning("fp32", CPU) is None
    assert select.low_precision_warning("bf16", torch.device("cuda")) is None
    flags(("avx512_bf16",))
    assert select.low_precision_warning("bf16", CPU) is None


def test_pretrain_warns_once_at_start_up(flags, caplog, tmp_path):
    """--bf16 on such a CPU: one warning line for the run, before training starts."""
    from hybrid.config import parse_args
    from hybrid.parallel.state import ParallelState
    from hybrid.train.trainer import pretrain
    flags(("avx2",))
    cfg = build_config(parse_args(["--num-layers", "1", "--hidden-size", "32",
                                   "--num-attention-heads", "4", "--seq-length", "16",
                                   "--micro-batch-size", "2", "--train-iters", "2",
                                   "--log-interval", "1", "--eval-iters", "0", "--bf16"]), 1)
    with caplog.at_level("INFO", logger="hybrid"):
        history = pretrain(cfg, ParallelState.single())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "without native bf16" in warnings[0], warnings
    messages = [r.getMessage() for r in caplog.records]
    first_iteration = next(i for i, m in enumerate(messages) if "lm loss" in m)
    assert messages.index(warnings[0]) < first_iteration
    assert len(history) == 2
