"""--compile: torch.compile of each block's forward follows the eager run to rounding,
alone and under activation checkpointing (full and selective).

torch.compile on the CPU takes tens of seconds, so one worker call runs every
variant: the compiled graphs of the first are reused by the next.
"""

import pytest
import torch

from hybrid.config import Flags, build_config
from tests.helpers.harness import run_ranks

FULL = {"recompute_granularity": "full"}  # uniform, one block per checkpoint
# Megatron's block method: only the first block checkpointed, the second compiled as usual
BLOCK = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
GROUP = {"recompute_granularity": "full", "recompute_method": "uniform",
         "recompute_num_layers": 2}  # both blocks in one group: block 0 runs without a graph
SELECTIVE = {"recompute_granularity": "selective"}  # the attention core inside the compiled block
RECOMPUTE = {"full": FULL, "block": BLOCK, "group": GROUP, "selective": SELECTIVE}
VARIANTS = {"eager": {}, "compile": {"compile": True},
            **{name: flags for name, flags in RECOMPUTE.items()},
            **{f"compile+{name}": {"compile": True, **flags} for name, flags in RECOMPUTE.items()}}


def _runs_compiled(block) -> bool:
    """Whether the forward ``block`` runs -- its checkpoint's inner one when checkpointed
    whole, so in the recompute too -- is the compiled one."""
    from hybrid.train.compile import compiled_forward
    forward = vars(block).get("forward")
    inner = getattr(forward, "inner", getattr(forward, "__func__", None))
    return inner is compiled_forward(type(block))


def _train(ps, flags):
    """2 steps (the second on Adam's moments of the first); (losses, the first step's
    gradient shard, parameters, compiled per block)."""
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    cfg = build_config(Flags(tensor_model_parallel_size=2, num_layers=2, hidden_size=32,
                num_attention_heads=4, seq_length=16, micro_batch_size=2, hidden_dropout=0.1,
                attention_dropout=0.1, zero_stage=3, zero_param_persistence_threshold=0,
                allgather_bucket_size=500, reduce_bucket_size=500, seed=3, lr=1e-2,
                # the attention key bias's true gradient is 0 (softmax ignores it): with a
                # tiny eps Adam turns its rounding noise into full steps (as in test_zero)
                adam_eps=1e-4, **flags), ps.world_size)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    model, ac, engine = build_engine(cfg, ps, 257, rng)
    assert (ac is not None) == ("recompute_granularity" in flags)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], None
    for _ in range(2):  # train_step's work, with the gradients read before the update
        d = torch.randint(0, 257, (2, 17), generator=g)
        engine.zero_grad()
        loss = model(d[:, :-1], d[:, 1:])
        engine.backward(loss)
        grads = engine.flat_grads.clone() if grads is None else grads
        engine.step(cfg.lr_schedule.lr, loss=loss.detach())
        losses.append(float(loss))
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params, [_runs_compiled(b) for b in model.blocks]


def _all_variants(ps):
    # inductor's C++ compiles in this process: a pool of compile workers costs more to
    # start on 2 cores than the 21 kernels take (11 s of a cold cache's 55)
    from torch._inductor import config
    with config.patch(compile_threads=1):
        return {name: _train(ps, flags) for name, flags in VARIANTS.items()}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all_variants, world_size=2, tp=2, timeout=600)


def _assert_close(got, want, what):
    (lg, gg, pg, _), (lw, gw, pw, _) = got, want
    for a, b in zip(lg, lw):
        assert abs(a - b) <= 1e-5 * abs(b), (what, lg, lw)
    torch.testing.assert_close(gg, gw, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
    for name, t in pw.items():
        torch.testing.assert_close(pg[name], t, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{what}, {name}: {m}")


def test_compiled_blocks_follow_the_eager_run(runs):
    """TP2, ZeRO-3 (hooks and gathers stay outside the graph), dropout on (the TP RNG
    tracker's streams through inductor's fallback_random): 2 steps compiled give
    the eager losses, gradients and parameters to rounding."""
    for r in runs:
        assert r["compile"][3] == [True, True] and r["eager"][3] == [False, False]
        _assert_close(r["compile"], r["eager"], "compile against eager")


@pytest.mark.parametrize("name", list(RECOMPUTE))
def test_compile_composes_with_recompute(runs, name):
    """Compiled and checkpointed (under ZeRO-3, whose gather fires again for the
    recompute, and with dropout, whose masks the recompute replays): the losses,
    gradients and parameters of compile alone and of recompute alone, to rounding.
    Blocks checkpointed whole run the compiled forward inside their checkpoint, so
    the recompute reruns the compiled code, not the eager one."""
    for r in runs:
        both = r[f"compile+{name}"]
        assert both[3] == [True, True], both[3]
        _assert_close(both, r["compile"], f"compile+{name} against compile")
        _assert_close(both, r[name], f"compile+{name} against {name}")
