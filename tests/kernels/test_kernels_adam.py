"""The fused AdamW step (csrc/cpu_adam.cpp, ZeRO-Offload's) against torch.optim.AdamW.

The reference is what a user would otherwise write: upcast the gradient,
unscale it by the loss scale, apply the clip coefficient, ``torch.optim.AdamW``
on fp32 masters (decay and no-decay groups), downcast for the model.
"""

import shutil

import pytest
import torch

from hybrid.kernels import build
from hybrid.kernels.adam import AdamSegments, adam_step, cpu_adam_ext

N = 10_007  # neither a multiple of the vector width nor of the thread chunk
DECAY = [(0, 4000), (5003, 9001)]  # two decayed ranges, no-decay between and after
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
LOSS_SCALE, CLIP = 1024.0, 0.37


@pytest.fixture(scope="module")
def ext():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    mod = cpu_adam_ext()
    assert mod is not None, "a C++ compiler is present but hybrid_cpu_adam did not build"
    return mod


def _pieces(decay_ranges, n):
    """(lo, hi, decayed) covering [0, n) in order."""
    out, pos = [], 0
    for lo, hi in decay_ranges:
        if lo > pos:
            out.append((pos, lo, False))
        out.append((lo, hi, True))
        pos = hi
    if pos < n:
        out.append((pos, n, False))
    return out


def _grads(steps, dtype, n=N):
    g = torch.Generator().manual_seed(7)
    # scaled gradients with a spread of magnitudes, as fp16 loss scaling leaves them
    return [(torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3 * LOSS_SCALE).to(dtype)
            for _ in range(steps)]


def _reference(init, grads, decay_ranges, weight_decay, out_dtype):
    pieces = _pieces(decay_ranges, init.numel())
    params = [torch.nn.Parameter(init[lo:hi].clone()) for lo, hi, _ in pieces]
    groups = [{"params": [p], "weight_decay": weight_decay if d else 0.0}
              for p, (_, _, d) in zip(params, pieces)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    for grad in grads:
        full = grad.float() / LOSS_SCALE * CLIP
        for p, (lo, hi, _) in zip(params, pieces):
            p.grad = full[lo:hi].clone()
        opt.step()
    master = torch.cat([p.detach() for p in params])
    return master, master.to(out_dtype)


def _fused(init, grads, decay_ranges, weight_decay, out_dtype, use_kernel=True):
    n = init.numel()
    master, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    segs = AdamSegments.from_ranges(n, decay_ranges, "cpu")
    for t, grad in enumerate(grads, start=1):
        found = adam_step(master, grad, m, v, out, segs, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                          eps=EPS, weight_decay=weight_decay, step=t,
                          grad_scale=CLIP / LOSS_SCALE, use_kernel=use_kernel)
        assert float(found) == 0.0
    return master, out


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_decay", [0.0, WD])
def test_fused_step_matches_torch_adamw_over_many_steps(ext, grad_dtype, weight_decay):
    init = torch.randn(N, generator=torch.Generator().manual_seed(3)) * 0.02
    grads = _grads(25, grad_dtype)
    ref_master, ref_out = _reference(init, grads, DECAY, weight_decay, grad_dtype)
    master, out = _fused(init, grads, DECAY, weight_decay, grad_dtype)
    assert (master - ref_master).abs().max().item() <= 1e-6
    assert not torch.equal(master, init)
    # the copy-out is the updated master rounded to nearest even, bit for bit
    assert torch.equal(out, master.to(grad_dtype))
    # ... and at most one rounding step away from the reference's downcast
    if grad_dtype != torch.float32:
        fi = torch.finfo(grad_dtype)  # (fp16 subnormals have a fixed absolute step)
        ulp = fi.eps * ref_master.abs().clamp_min(fi.smallest_normal)
        assert ((out.float() - ref_out.float()).abs() <= ulp).all()


def test_fused_step_without_copy_out_and_odd_tiny_sizes(ext):
    for n in (1, 7, 8, 9, 63, 65, 130):
        init = torch.randn(n, generator=torch.Generator().manual_seed(n))
        grads = _grads(5, torch.float32, n)
        decay = [(0, n // 2)] if n > 1 else []
        ref_master, _ = _reference(init, grads, decay, WD, torch.float32)
        master, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
        segs = AdamSegments.from_ranges(n, decay, "cpu")
        for t, g in enumerate(grads, start=1):
            adam_step(master, g, m, v, None, segs, lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                      eps=EPS, weight_decay=WD, step=t, grad_scale=CLIP / LOSS_SCALE)
        assert (master - ref_master).abs().max().item() <= 1e-6, n


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", [5, 4096, N - 1])  # vector body and scalar tail
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_gradient_element_is_reported(ext, grad_dtype, where, bad):
    grad = _grads(1, grad_dtype)[0]
    segs = AdamSegments.from_ranges(N, DECAY, "cpu")
    clean = adam_step(torch.zeros(N), grad, torch.zeros(N), torch.zeros(N), None, segs, lr=LR,
                      beta1=0.9, beta2=0.95, eps=EPS, weight_decay=WD, step=1)
    assert float(clean) == 0.0
    grad[where] = bad
    found = adam_step(torch.zeros(N), grad, torch.zeros(N), torch.zeros(N), None, segs, lr=LR,
                      beta1=0.9, beta2=0.95, eps=EPS, weight_decay=WD, step=1)
    assert float(found) == 1.0


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_torch_fallback_gives_the_kernels_numbers(ext, grad_dtype):
    init = torch.randn(N, generator=torch.Generator().manual_seed(3)) * 0.02
    grads = _grads(10, grad_dtype)
    a, out_a = _fused(init, grads, DECAY, WD, grad_dtype, use_kernel=True)
    b, out_b = _fused(init, grads, DECAY, WD, grad_dtype, use_kernel=False)
    assert (a - b).abs().max().item() <= 1e-6
    assert (out_a.float() - out_b.float()).abs().max().item() <= 2 * torch.finfo(grad_dtype).eps


def test_no_kernels_forces_the_fallback():
    """--no-kernels (or HYBRID_NO_KERNELS=1, read by the config layer) reaches the
    build through hybrid.kernels.configure: no extension, the torch ops instead."""
    from dataclasses import replace

    from hybrid import kernels
    from hybrid.config import build_config, kernel_config_from_env, parse_args
    assert kernel_config_from_env({"HYBRID_NO_KERNELS": "1"}).no_kernels
    assert not kernel_config_from_env({"HYBRID_NO_KERNELS": "0"}).no_kernels
    assert build_config(parse_args(["--no-kernels"]), 1).kernels.no_kernels
    # the entry point's environment defaults the flag, in one place
    assert build_config(parse_args([]), 1, environ={"HYBRID_NO_KERNELS": "1"}).kernels.no_kernels
    assert not build_config(parse_args([]), 1).kernels.no_kernels  # no environment: flags only
    before = kernels.current()
    kernels.configure(replace(before, no_kernels=True))
    try:
        assert cpu_adam_ext() is None
        # and the step still runs, through the torch ops
        segs = AdamSegments.from_ranges(10, [(0, 5)], "cpu")
        master = torch.ones(10)
        adam_step(master, torch.ones(10), torch.zeros(10), torch.zeros(10), None, segs, lr=0.1,
                  beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
        assert torch.allclose(master, torch.full((10,), 0.9))
    finally:
        kernels.configure(before)


def test_a_kernel_that_cannot_build_falls_back_with_one_line(monkeypatch, caplog):
    monkeypatch.setattr(build, "_loaded", {})
    with caplog.at_level("WARNING", logger="hybrid"):
        assert build.load_extension("hybrid_missing", ["no_such_file.cpp"]) is None
    lines = [r for r in caplog.records if "hybrid_missing" in r.getMessage()]
    assert len(lines) == 1 and "no_such_file.cpp" in lines[0].getMessage()


def test_segments_cover_the_shard():
    segs = AdamSegments.from_ranges(100, [(50, 60), (0, 10)], "cpu")
    assert segs.ranges() == [(0, 10, True), (10, 50, False), (50, 60, True), (60, 100, False)]
    assert AdamSegments.from_ranges(5, [], "cpu").ranges() == [(0, 5, False)]
    assert AdamSegments.from_ranges(5, [(0, 5)], "cpu").ranges() == [(0, 5, True)]


def _state(n, seed=3):
    init = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02
    return [init.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)]


@pytest.mark.parametrize("use_kernel", [True, False])
def test_scalars_tensor_gives_the_bits_of_host_arguments(ext, use_kernel):
    """[grad_scale, step, skip] as an fp64 tensor (the engine's device-side clip
    coefficient and step count) gives exactly the host-argument step; skip != 0
    leaves master, moments, out and the flag untouched even over an inf."""
    grads = _grads(6, torch.bfloat16)
    segs = AdamSegments.from_ranges(N, DECAY, "cpu")
    host, dev = _state(N), _state(N)
    hp = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
              use_kernel=use_kernel)
    for t, g in enumerate(grads, start=1):
        scale = CLIP / LOSS_SCALE / t
        adam_step(*host[:1], g, *host[1:3], host[3], segs, step=t, grad_scale=scale, **hp)
        sc = torch.tensor([scale, float(t), 0.0], dtype=torch.float64)
        adam_step(*dev[:1], g, *dev[1:3], dev[3], segs, step=999, grad_scale=5.0, scalars=sc,
                  **hp)
        for a, b in zip(host, dev):
            assert torch.equal(a, b), t
    before = [x.clone() for x in dev]
    bad = grads[0].clone()
    bad[17] = float("inf")
    found = adam_step(*dev[:1], bad, *dev[1:3], dev[3], segs, step=1,
                      scalars=torch.tensor([1.0, 7.0, 1.0], dtype=torch.float64), **hp)
    assert float(found) == 0.0
    for a, b in zip(before, dev):
        assert torch.equal(a, b)


def test_pieces_and_thread_counts_give_the_bits_of_one_call(ext):
    """Built with -ffp-contract=off, every element takes the same arithmetic in the
    vector body and the scalar tail: the shard cut into calls at odd places, or run
    on another number of threads, updates bit for bit like one call (what lets the
    engine call the kernel per unit, and makes results independent of the machine)."""
    n, grads = 20_011, _grads(3, torch.bfloat16, 20_011)
    decay = [(0, 5000), (9000, 15001)]

    def run(cuts, threads):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            p, m, v, out = _state(n)
            for t, g in enumerate(grads, start=1):
                for lo, hi in cuts:
                    segs = AdamSegments.from_ranges(
                        hi - lo, [(max(a, lo) - lo, min(b, hi) - lo) for a, b in decay
                                  if a < hi and b > lo], "cpu")
                    adam_step(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], out[lo:hi], segs, lr=LR,
                              beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, step=t,
                              grad_scale=CLIP / LOSS_SCALE)
            return p, m, v, out
        finally:
            torch.set_num_threads(old)

    whole = run([(0, n)], 1)
    for cuts, threads in (([(0, 37), (37, 5003), (5003, n)], 1), ([(0, n)], 2),
                          ([(0, 9), (9, n)], 2)):
        for a, b in zip(whole, run(cuts, threads)):
            assert torch.equal(a, b), (cuts, threads)


def _shard(sizes, flat_grad, monkeypatch=None):
    """A ShardAdamW over parts of ``sizes`` (views of flat buffers), decay on each
    part's first half, from the same initial master every time."""
    from hybrid.kernels.adam import ShardAdamW
    n = sum(sizes)
    flat = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.02,
            torch.zeros(n), torch.zeros(n))
    parts = [list(t.split(sizes)) for t in flat]
    decay = [[(0, s // 2)] if s > 1 else [] for s in sizes]
    return ShardAdamW(*parts, decay, (BETAS[0], BETAS[1], EPS, WD), flat, flat_grad)


@pytest.mark.parametrize("use_flat_grad", [True, False])
def test_shard_adamw_chooses_a_path_once_and_always_writes_out(ext, use_flat_grad, monkeypatch):
    """The compiled kernel only with a flat gradient to read in one pass, else torch's
    fused AdamW, else (a torch without it) the eager ops: all give torch.optim.AdamW's
    numbers to rounding, write every part's master into ``out`` in its dtype, and
    change nothing on a skipped step."""
    from hybrid.kernels import adam
    sizes = [37, 100, 1, 63]
    grads = _grads(4, torch.bfloat16, sum(sizes))
    flat_grad = torch.empty(sum(sizes), dtype=torch.bfloat16)
    runs = {}
    for eager in (False, True):
        monkeypatch.setattr(adam, "_TORCH_FUSED", not eager)
        opt = _shard(sizes, flat_grad if use_flat_grad else None)
        out = torch.empty(sum(sizes), dtype=torch.bfloat16)
        for t, g in enumerate(grads, start=1):
            flat_grad.copy_(g)
            skip = 1.0 if t == 3 else 0.0
            before = [m.clone() for m in opt.master]
            opt.step(list(flat_grad.split(sizes)), LR,
                     torch.tensor([CLIP / LOSS_SCALE, float(t - (t > 3)), skip],
                                  dtype=torch.float64), out=list(out.split(sizes)))
            if skip:
                assert all(torch.equal(a, b) for a, b in zip(before, opt.master))
        assert torch.equal(out, torch.cat(opt.master).to(torch.bfloat16))
        runs[opt.path] = torch.cat(opt.master)
    want = (["kernel"] if use_flat_grad else ["torch", "eager"])
    assert sorted(runs) == sorted(want)
    starts = [0, 37, 137, 138]
    ref, _ = _reference(_shard(sizes, None).flat[0], [g for i, g in enumerate(grads) if i != 2],
                        [(o, o + s // 2) for o, s in zip(starts, sizes) if s > 1], WD,
                        torch.float32)
    for master in runs.values():
        assert (master - ref).abs().max().item() <= 1e-6


def test_the_kernel_cache_follows_the_variables_in_order():
    """HYBRID_KERNEL_CACHE, else TORCH_EXTENSIONS_DIR/hybrid (what DeepSpeed's users set to
    move its JIT ops), else XDG_CACHE_HOME/hybrid/kernels, else the default (None)."""
    from hybrid.config import kernel_config_from_env
    env = {"HYBRID_KERNEL_CACHE": "/a", "TORCH_EXTENSIONS_DIR": "/b", "XDG_CACHE_HOME": "/c"}
    assert kernel_config_from_env(env).cache_dir == "/a"
    del env["HYBRID_KERNEL_CACHE"]
    assert kernel_config_from_env(env).cache_dir == "/b/hybrid"
    del env["TORCH_EXTENSIONS_DIR"]
    assert kernel_config_from_env(env).cache_dir == "/c/hybrid/kernels"
    assert kernel_config_from_env({}).cache_dir is None
