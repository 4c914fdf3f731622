"""--attention-backend picks torch's SDPA kernels; one that cannot run is refused up front."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.errors import ConfigError
from hybrid.kernels.attention import attention_context, check_attention_backend

CPU = torch.device("cpu")


def test_backends_that_run_on_the_cpu_give_the_same_attention():
    q, k, v = torch.randn(3, 2, 4, 16, 8, generator=torch.Generator().manual_seed(0))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for name in ("auto", "flash", "unfused", "local"):
        check_attention_backend(name, CPU, torch.float32, 8, 0.0)
        with attention_context(name):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,dropout,needle", [
    ("fused", 0.0, "No viable backend"),
    ("flash", 0.1, "do not support non-zero dropout"),
])
def test_a_backend_that_cannot_run_here_is_a_named_error(name, dropout, needle):
    with pytest.raises(ConfigError) as e:
        check_attention_backend(name, CPU, torch.float32, 8, dropout)
    msg = str(e.value)
    assert msg.startswith(f"--attention-backend {name} cannot run on this cpu") and needle in msg
    assert "--attention-backend auto" in msg


def test_the_flag_reaches_the_model_and_a_run_that_cannot_use_it_stops_at_start():
    from tests.helpers.launch import TINY, pretrain
    r = pretrain(1, TINY + ["--train-iters", "1", "--attention-backend", "fused"])
    assert r.returncode == 2
    assert "pretrain_gpt.py: error: --attention-backend fused cannot run on this cpu" in r.stderr
    from hybrid.config import build_config, parse_args
    from hybrid.parallel.state import ParallelState
    from hybrid.train.setup import build_model
    cfg = build_config(parse_args(TINY + ["--use-flash-attn"]), 1)
    model = build_model(cfg, ParallelState.single(), 257, rng=None, device="meta")
    assert {b.attn.core.backend for b in model.blocks} == {"flash"}
