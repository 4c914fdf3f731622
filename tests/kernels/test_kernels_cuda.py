"""Fused CUDA kernels (csrc/cuda) against their PyTorch fallbacks.

Skipped without CUDA. They force the kernel path with ``hybrid.kernels.configure``
(what --kernel-choice sets; the ``choose`` fixture of conftest.py) and compare
forward and backward with explicit per-dtype tolerances. The selection layer and
the fallbacks themselves: tests/kernels/test_kernels_select.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid.kernels import bias_gelu, layer_norm, local_softmax_stats, softmax_grad
from hybrid.kernels.cross_entropy import grad_eager

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) for the kernel vs the eager op, same input dtype
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def _ops():
    from hybrid.kernels.cuda_ops import cuda_ops
    ops = cuda_ops()
    assert ops is not None, "hybrid_cuda_ops failed to build (see the log line above)"
    return ops


def _close(a, b, dtype, scale=1.0):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol * scale)


# ---------------------------------------------------------------- LayerNorm
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 8), (37, 1000), (129, 2048), (5, 1023),
                                       (64, 4096), (33, 8192), (3, 12288), (17, 20000)])
def test_layer_norm(dtype, rows, cols, choose):
    _ops()
    g = torch.Generator(device="cuda").manual_seed(rows * cols)
    x = (torch.randn(rows, cols, device="cuda", generator=g) * 3 + 1).to(dtype)
    w = (1 + 0.1 * torch.randn(cols, device="cuda", generator=g)).to(dtype)
    b = (0.1 * torch.randn(cols, device="cuda", generator=g)).to(dtype)
    dy = torch.randn(rows, cols, device="cuda", generator=g).to(dtype)

    def run(path):
        choose(f"layer_norm={path}")
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = layer_norm(xs, ws, bs, 1e-5)
        y.backward(dy)
        return y, xs.grad, ws.grad, bs.grad

    fused, eager = run("fused"), run("eager")
    _close(fused[0], eager[0], dtype)
    _close(fused[1], eager[1], dtype)
    # dweight/dbias sum over rows: absolute error grows with sqrt(rows)
    _close(fused[2], eager[2], dtype, scale=math.sqrt(rows))
    _close(fused[3], eager[3], dtype, scale=math.sqrt(rows))


@cuda
def test_layer_norm_stats_and_3d():
    ops = _ops()
    x = torch.randn(2, 5, 2048, device="cuda") * 2 + 3
    w, b = torch.ones(2048, device="cuda"), torch.zeros(2048, device="cuda")
    y, mean, rstd = ops.layer_norm_fwd(x, w, b, 1e-5)
    torch.testing.assert_close(mean, x.view(-1, 2048).mean(-1))
    var = x.view(-1, 2048).var(-1, unbiased=False)
    torch.testing.assert_close(rstd, (var + 1e-5).rsqrt())
    torch.testing.assert_close(y, F.layer_norm(x, (2048,), w, b, 1e-5), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- bias GELU
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 1000), (2, 33, 8192), (257, 2048), (7, 13), (1, 24)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(dtype, shape, approximate, choose):
    _ops()
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(*shape, device="cuda", generator=g) * 2).to(dtype)
    b = torch.randn(shape[-1], device="cuda", generator=g).to(dtype)
    dy = torch.randn(*shape, device="cuda", generator=g).to(dtype)

    def run(path):
        choose(f"bias_gelu={path}")
        xs, bs = x.clone().requires_grad_(), b.clone().requires_grad_()
        y = bias_gelu(xs, bs, approximate)
        y.backward(dy)
        return y, xs.grad, bs.grad

    fused, eager = run("fused"), run("eager")
    rows = x.numel() // shape[-1]
    _close(fused[0], eager[0], dtype)
    _close(fused[1], eager[1], dtype)
    _close(fused[2], eager[2], dtype, scale=math.sqrt(rows))


# ---------------------------------------------------------------- cross-entropy
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,valid", [(5, 1000, 1000), (33, 25152, 25152),
                                             (17, 50304, 50257), (9, 1001, 990), (4, 64, 0)])
def test_cross_entropy_pieces(dtype, rows, cols, valid, choose):
    _ops()
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = (torch.randn(rows, cols, device="cuda", generator=g) * 8).to(dtype)
    start = 1000
    t = torch.randint(start - 50, start + cols + 50, (rows,), device="cuda", generator=g)
    t[0] = start  # at least one target on this rank
    t = t.clamp(max=start + max(valid, 1) - 1)
    gl = torch.rand(rows, device="cuda", generator=g) + 0.5

    choose("cross_entropy=fused")
    m, s, tl = local_softmax_stats(x, t, start, valid)
    choose("cross_entropy=eager")
    rm, rs, rtl = local_softmax_stats(x, t, start, valid)
    assert torch.equal(m, rm) and torch.equal(tl, rtl)  # max and a gather are exact
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=0)
    if valid == 0:
        assert torch.isinf(m).all() and (s == 0).all()
        return
    # pretend this rank is the world: M = m, S = s
    choose("cross_entropy=fused")
    grad = softmax_grad(x, t, start, valid, m, s, gl)
    ref = grad_eager(x, t, start, valid, rm, rs, gl)
    assert grad.dtype == dtype
    _close(grad, ref, dtype, scale=0.1)
    assert (grad[:, valid:] == 0).all()
    # and against autograd through F.cross_entropy
    xr = x[:, :valid].float().requires_grad_()
    F.cross_entropy(xr, t - start, reduction="none").backward(gl)
    _close(grad[:, :valid], xr.grad, dtype, scale=0.1)


@cuda
def test_vocab_parallel_loss_kernel_vs_eager_single_rank(choose):
    """The kernel-backed stats give F.cross_entropy's loss (TP world of one)."""
    _ops()
    x = torch.randn(64, 50304, device="cuda", dtype=torch.bfloat16) * 4
    t = torch.randint(0, 50257, (64,), device="cuda")
    choose("cross_entropy=fused")
    m, s, tl = local_softmax_stats(x, t, 0, 50257)
    loss = s.log() - (tl - m)
    ref = F.cross_entropy(x[:, :50257].float(), t, reduction="none")
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- Adam
def _segs(n, device):
    from hybrid.kernels.adam import AdamSegments
    return AdamSegments.from_ranges(n, [(0, n // 3), (n // 2, n // 2 + 1), (n - 7, n)], device)


@cuda
@pytest.mark.parametrize("n", [1, 7, 4096 + 3, 1_000_003])
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_fused_adam_matches_reference(n, grad_dtype, out_dtype):
    from hybrid.kernels.adam import adam_step_reference
    ops = _ops()
    g = torch.Generator(device="cuda").manual_seed(n)
    p0 = torch.randn(n, device="cuda", generator=g)
    segs = _segs(n, "cuda")
    state = {k: [p0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
             for k in ("fused", "ref")}
    outs = {k: (torch.empty(n, device="cuda", dtype=out_dtype) if out_dtype else None)
            for k in state}
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, 6):
        grad = (torch.randn(n, device="cuda", generator=g) * 100).to(grad_dtype)
        scale = 1.0 / 128 if step % 2 else 1.0
        args = (hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], step, scale)
        fi = {k: torch.zeros(1, device="cuda") for k in state}
        ops.adam_step(*state["fused"][:1], grad, *state["fused"][1:], outs["fused"],
                      segs.bounds, segs.decay, *args, fi["fused"])
        adam_step_reference(state["ref"][0], grad, state["ref"][1], state["ref"][2], outs["ref"],
                            segs, *args, fi["ref"])
        assert fi["fused"].item() == 0.0
    (pf, mf, vf), (pr, mr, vr) = state["fused"], state["ref"]
    torch.testing.assert_close(pf, pr, rtol=1e-5, atol=1e-6)
    # moments: FMA contraction on the GPU rounds differently, and m = b1*m + (1-b1)*g
    # cancels towards 0, so their error is relative to their scale, not to each value
    for a, b in ((mf, mr), (vf, vr)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    if out_dtype is not None:
        torch.testing.assert_close(outs["fused"], state["fused"][0].to(out_dtype), rtol=0, atol=0)
        torch.testing.assert_close(outs["fused"].float(), outs["ref"].float(),
                                   rtol=TOL[out_dtype][0], atol=1e-6)


@cuda
def test_fused_adam_decay_segments_and_found_inf():
    ops = _ops()
    n = 10_001
    segs = _segs(n, "cuda")
    p = torch.ones(n, device="cuda")
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    grad = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    fi = torch.zeros(1, device="cuda")
    # zero grad: only decay moves p, exactly by (1 - lr * wd) on decayed segments
    ops.adam_step(p, grad, m, v, None, segs.bounds, segs.decay, 0.1, 0.9, 0.999, 1e-8, 0.5, 1,
                  1.0, fi)
    want = torch.ones(n, device="cuda")
    for lo, hi, decay in segs.ranges():
        if decay:
            want[lo:hi] = float(torch.tensor(1.0 - 0.1 * 0.5, dtype=torch.float32))
    assert torch.equal(p, want) and fi.item() == 0.0
    for bad in (float("inf"), float("nan")):
        g2 = torch.zeros(n, device="cuda", dtype=torch.float16)
        g2[n - 2] = bad
        fi = torch.zeros(1, device="cuda")
        ops.adam_step(p.clone(), g2, m.clone(), v.clone(), None, segs.bounds, segs.decay, 0.1,
                      0.9, 0.999, 1e-8, 0.0, 2, 1.0, fi)
        assert fi.item() == 1.0
    fi = torch.ones(1, device="cuda")  # never reset by a clean step
    ops.adam_step(p, grad, m, v, None, segs.bounds, segs.decay, 0.1, 0.9, 0.999, 1e-8, 0.0, 2,
                  1.0, fi)
    assert fi.item() == 1.0


@cuda
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_fused_adam_device_scalars_are_the_host_arguments(out_dtype):
    """[grad_scale, step, skip] in device memory (the engine's sync-free step) gives
    the host-argument step bit for bit; skip leaves every buffer untouched."""
    ops = _ops()
    n = 100_003
    segs = _segs(n, "cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    p0 = torch.randn(n, device="cuda", generator=g)
    st = {k: [p0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"),
              torch.empty(n, device="cuda", dtype=out_dtype) if out_dtype else None]
          for k in ("host", "dev")}
    hp = (1e-3, 0.9, 0.95, 1e-8, 0.1)
    for step in range(1, 5):
        grad = (torch.randn(n, device="cuda", generator=g) * 100).to(torch.bfloat16)
        scale = 0.37 / step
        p, m, v, out = st["host"]
        ops.adam_step(p, grad, m, v, out, segs.bounds, segs.decay, *hp, step, scale,
                      torch.zeros(1, device="cuda"))
        p, m, v, out = st["dev"]
        sc = torch.tensor([scale, float(step), 0.0], dtype=torch.float64, device="cuda")
        ops.adam_step(p, grad, m, v, out, segs.bounds, segs.decay, *hp, 999, 5.0,
                      torch.zeros(1, device="cuda"), sc)
        for a, b in zip(st["host"], st["dev"]):
            assert a is None or torch.equal(a, b), step
    before = [None if x is None else x.clone() for x in st["dev"]]
    bad = torch.full((n,), float("inf"), device="cuda")
    fi = torch.zeros(1, device="cuda")
    p, m, v, out = st["dev"]
    ops.adam_step(p, bad, m, v, out, segs.bounds, segs.decay, *hp, 1, 1.0, fi,
                  torch.tensor([1.0, 9.0, 1.0], dtype=torch.float64, device="cuda"))
    assert fi.item() == 0.0
    for a, b in zip(before, st["dev"]):
        assert a is None or torch.equal(a, b)


# ---------------------------------------------------------------- model wiring
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_fused_matches_eager(dtype, choose):
    from hybrid.config.model import ModelConfig
    from hybrid.parallel.state import ParallelState
    from models.gpt import GPT
    cfg = ModelConfig(vocab_size=1000, num_layers=2, hidden_size=256,  # 1024 rows
                      num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0,
                      attention_dropout=0.0)
    ps = ParallelState.single("cuda")
    model = GPT(cfg, ps.tp_group, device="cuda").to(dtype)
    tok = torch.randint(0, 1000, (2, 64), device="cuda")
    lab = torch.randint(0, 1000, (2, 64), device="cuda")
    res = {}
    for path in ("eager", "fused"):
        choose(f"all={path}")
        model.zero_grad()
        loss = model(tok, lab)
        loss.backward()
        res[path] = (loss.detach().float(), model.blocks[0].mlp.fc.bias.grad.float().clone(),
                     model.blocks[1].ln_1.weight.grad.float().clone())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(res["fused"], res["eager"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * 0.1)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_function_fused_single_rank(dtype, choose):
    """TP=1 on GPU routes through the fused Function (all-reduces are no-ops) and
    matches F.cross_entropy over the valid columns, padding getting zero gradient."""
    from hybrid.parallel.state import ParallelState
    from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    _ops()
    ps = ParallelState.single("cuda")
    x = (torch.randn(4, 50, 1024, device="cuda") * 4).to(dtype)
    t = torch.randint(0, 1000, (4, 50), device="cuda")
    gl = torch.rand(4, 50, device="cuda")
    choose("cross_entropy=fused")
    xs = x.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(xs, t, ps.tp_group, valid=1000)
    loss.backward(gl)
    xr = x[..., :1000].float().requires_grad_()
    ref = F.cross_entropy(xr.flatten(0, 1), t.flatten(), reduction="none").view(4, 50)
    ref.backward(gl)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    assert xs.grad.dtype == dtype and (xs.grad[..., 1000:] == 0).all()
    _close(xs.grad[..., :1000], xr.grad, dtype, scale=0.1)
