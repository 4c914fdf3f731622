"""ZeRO-R: recompute (partitioned, on the host, contiguous) gives the same gradients."""

import pytest
import torch

from harness import run_ranks
from hybrid.activation_checkpointing import apply_activation_checkpointing
from hybrid.config import TrainConfig
from hybrid.tensor_parallel import seed_all
from hybrid.training import build_model

VARIANTS = {
    "none": {},
    "recompute": {"recompute_activations": True},
    "partition": {"recompute_activations": True, "partition_activations": True},
    "partition+cpu": {"recompute_activations": True, "partition_activations": True,
                      "cpu_checkpointing": True},
    "partition+cpu+contiguous": {"recompute_activations": True, "partition_activations": True,
                                 "cpu_checkpointing": True, "contiguous_checkpointing": True},
    "first layer only": {"recompute_activations": True, "partition_activations": True,
                         "recompute_num_layers": 1},
}
B, T = 3, 10


def _grads(ps, tp, hidden, steps=3):
    out = {}
    for name, kw in VARIANTS.items():
        cfg = TrainConfig(tensor_model_parallel_size=tp, num_layers=2, hidden_size=hidden,
                          num_attention_heads=4, seq_length=T, hidden_dropout=0.1,
                          attention_dropout=0.1, seed=3, **kw).validate(ps.world_size)
        rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
        model = build_model(cfg, ps, 257, rng)
        model.train()
        ac = apply_activation_checkpointing(model, ps, rng, cfg) if kw else None
        g = torch.Generator().manual_seed(0)
        allocs, peaks = [], []
        for _ in range(steps):
            x = torch.randint(0, 257, (B, T + 1), generator=g)
            model.zero_grad()
            loss = model(x[:, :-1], x[:, 1:])
            if ac is not None:
                peaks.append(ac.stored_bytes())  # everything stored, nothing restored yet
            loss.backward()
            if ac is not None:
                allocs.append(ac.allocations)
                assert ac.stored_bytes() == 0
        out[name] = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                     "allocs": allocs, "peak": peaks[-1] if peaks else None}
    return out


@pytest.mark.parametrize("tp,hidden", [(2, 36), (4, 36)])
def test_recompute_variants_match_no_checkpointing(tp, hidden):
    """Dropout on: the masks in the recompute equal the forward's (exact grads)."""
    res = run_ranks(_grads, world_size=tp, tp=tp, args=(tp, hidden))
    for r in res:
        ref = r["none"]["grads"]
        for name in VARIANTS:
            for pname, g in r[name]["grads"].items():
                torch.testing.assert_close(g, ref[pname], rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"{name} {pname}: {m}")
        full = r["recompute"]["peak"]
        per_layer = B * T * hidden * 4
        assert full == 2 * per_layer  # two layers, fp32 inputs
        for name in ("partition", "partition+cpu", "partition+cpu+contiguous"):
            assert r[name]["peak"] == 2 * (-(-B * T * hidden // tp)) * 4  # 1/TP, padded
            assert r[name]["peak"] <= full / tp + 2 * tp * 4
        assert r["first layer only"]["peak"] == -(-B * T * hidden // tp) * 4
        # buffers come once, in the first step; later steps allocate none
        a = r["partition+cpu+contiguous"]["allocs"]
        assert a[0] == a[-1] and a[0]["gather"] == 1 and a[0]["contiguous"] == 1
        assert a[0]["tensor"] == 0 and a[0]["staging"] == 1
        assert r["partition"]["allocs"][-1]["gather"] == 1


def _odd_sized(ps):
    from hybrid.activation_checkpointing import CheckpointStore
    x = torch.arange(105, dtype=torch.float32).view(3, 5, 7)  # 105 = 4 * 27 - 3
    store = CheckpointStore(ps, partition=True, cpu=True, contiguous=True, num_slots=2)
    s0, s1 = store.stash(0, x), store.stash(1, x * 2)
    held = store.stored_bytes
    back1, back0 = store.restore(s1).clone(), store.restore(s0).clone()
    return held, back0, back1


def test_partition_pads_sizes_that_do_not_divide_by_tp():
    for held, back0, back1 in run_ranks(_odd_sized, world_size=4, tp=4):
        assert held == 2 * 27 * 4  # ceil(105 / 4) elements per slice, two slots
        x = torch.arange(105, dtype=torch.float32).view(3, 5, 7)
        assert torch.equal(back0, x) and torch.equal(back1, 2 * x)
