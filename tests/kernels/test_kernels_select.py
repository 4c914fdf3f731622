"""Kernel selection and the PyTorch fallbacks (hybrid/kernels/select.py), on any machine.

The fallbacks are the references the CUDA kernels are held to
(tests/kernels/test_kernels_cuda.py); a missing GPU or --no-kernels means no kernel and
no exception; a bad --kernel-choice is one clear error; the build cache is keyed
on the GPU architecture.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hybrid import kernels
from hybrid.config import build_config, parse_kernel_choice
from hybrid.config.sections import KernelConfig
from hybrid.kernels import bias_gelu, layer_norm, local_softmax_stats, softmax_grad
from hybrid.kernels.select import kernel_choice

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

def test_cpu_paths_are_the_references(choose):
    choose("all=fused")  # ignored on CPU
    assert kernel_choice("layer_norm", torch.device("cpu")) == "eager"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 40, generator=g)
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    assert torch.equal(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (40,), w, b, 1e-5))
    for approximate in ("tanh", "none"):
        assert torch.equal(bias_gelu(x, b, approximate), F.gelu(x + b, approximate=approximate))
    from hybrid.kernels import LayerNorm
    ln = LayerNorm(40)
    ref = torch.nn.LayerNorm(40)
    assert list(ln.state_dict()) == list(ref.state_dict())
    assert torch.equal(ln(x), ref(x))


def test_cpu_cross_entropy_helpers():
    g = torch.Generator().manual_seed(1)
    N, V, valid, start = 6, 24, 19, 48
    x = torch.randn(N, V, generator=g) * 20
    t = torch.tensor([48, 50, 66, 3, 100, 60])  # in range, in range, in range, below, above, in
    m, s, tl = local_softmax_stats(x, t, start, valid)
    real = x[:, :valid]
    torch.testing.assert_close(m, real.max(-1).values)
    torch.testing.assert_close(s, (real - m[:, None]).exp().sum(-1))
    inside = (t >= start) & (t < start + V)
    ref_tl = torch.where(inside, x.gather(1, (t - start).clamp(0, V - 1)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(tl, ref_tl)
    # -inf masked padding gives the same stats as `valid`
    masked = x.clone()
    masked[:, valid:] = float("-inf")
    for a, b in zip(local_softmax_stats(masked, t, start, None), (m, s, tl)):
        torch.testing.assert_close(a, b)
    # gradient = (softmax - onehot) * g with this rank alone as the "world"
    xr = real.clone().requires_grad_()
    gl = torch.linspace(0.5, 1.5, N)
    tt = (t - start).clamp(0, valid - 1)
    keep = inside & (t - start < valid)
    loss = torch.logsumexp(xr, -1) - xr.gather(1, tt[:, None])[:, 0] * keep
    loss.backward(gl)
    grad = softmax_grad(x, t, start, valid, m, s, gl)
    torch.testing.assert_close(grad[:, :valid], xr.grad)
    assert (grad[:, valid:] == 0).all()
    # a rank whose columns are all padding: m = -inf, s = 0, zero gradient
    m0, s0, _ = local_softmax_stats(x, t, start, 0)
    assert torch.isinf(m0).all() and (s0 == 0).all()


def test_no_kernel_without_cuda_or_when_disabled():
    from hybrid.kernels.cuda_ops import cuda_ops
    before = kernels.current()
    try:
        kernels.configure(replace(before, no_kernels=True))  # forgets what was loaded
        assert cuda_ops() is None
        assert kernel_choice("layer_norm", torch.device("cuda")) == "eager"
        if not torch.cuda.is_available():
            kernels.configure(replace(before, no_kernels=False))
            assert cuda_ops() is None
    finally:
        kernels.configure(before)


def test_bad_choice_is_a_clear_error():
    """A bad op or path is refused where the settings are made, naming the flag or
    the variable it came from; ops take only their own paths."""
    from hybrid.config import kernel_config_from_env, parse_args
    from hybrid.errors import ConfigError
    with pytest.raises(ConfigError, match="--kernel-choice: bad entry 'layer_norm=fast'"):
        build_config(parse_args(["--kernel-choice", "layer_norm=fast"]), 1)
    with pytest.raises(ConfigError, match="HYBRID_KERNEL_CHOICE: bad entry 'linear=fused'"):
        kernel_config_from_env({"HYBRID_KERNEL_CHOICE": "linear=fused"})
    with pytest.raises(ValueError, match="bias_gelu=fp32"):
        KernelConfig(choice=(("bias_gelu", "fp32"),))
    assert parse_kernel_choice("all=fused, linear=fp32", "x") == (
        ("layer_norm", "fused"), ("bias_gelu", "fused"), ("cross_entropy", "fused"),
        ("adam", "fused"), ("linear", "fp32"))


def test_cache_key_names_the_gpu_architecture(tmp_path):
    """A kernel cache shared by machines: a build for sm_90 is never the one an sm_80
    process loads. The key changes with the compute capability, TORCH_CUDA_ARCH_LIST,
    the CUDA and torch versions, the sources; a CPU-only build ignores the GPU."""
    from hybrid.kernels.build import cache_key
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k() {}")
    flags = (["-O3"], ["-O3"], [])
    base = dict(cuda=True, capability=(9, 0), arch_list=None, torch_version="2.13.0",
                cuda_version="13.0", cpu="flags : avx2")
    k90 = cache_key([src], flags, **base)
    assert cache_key([src], flags, **base) == k90 and len(k90) == 16
    for change in ({"capability": (8, 0)}, {"capability": (9, 1)}, {"arch_list": "8.0;9.0"},
                   {"cuda_version": "12.8"}, {"torch_version": "2.12.0"}):
        assert cache_key([src], flags, **{**base, **change}) != k90, change
    cpu = {**base, "cuda": False}
    assert cache_key([src], flags, **cpu) == \
        cache_key([src], flags, **{**cpu, "capability": (8, 0)})
    src.write_text("__global__ void k() { }")
    assert cache_key([src], flags, **base) != k90


def test_cuda_build_directory_follows_the_device(tmp_path, monkeypatch):
    """_build asks the current device for its capability: a fake sm_80 and sm_90 get
    two build directories under the configured cache."""
    from torch.utils import cpp_extension

    from hybrid.kernels import build
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k() {}")
    dirs = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: dirs.append(kw["build_directory"]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    before = kernels.current()
    kernels.configure(replace(before, cache_dir=str(tmp_path / "cache")))
    try:
        for cap in ((9, 0), (8, 0), (9, 0)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
            build._build("hybrid_test", [src], True, [], [], [])
    finally:
        kernels.configure(before)
    assert dirs[0] == dirs[2] != dirs[1]
    assert all(d.startswith(str(tmp_path / "cache" / "hybrid_test-")) for d in dirs)
