"""ZeRO stages 0-3 against a one-process torch reference: losses, params, norms, bytes."""

import shutil

import pytest
import torch

from hybrid.estimate.model_states import comm_bytes_per_step, model_state_bytes
from hybrid.parallel.state import ParallelState
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import (
    BUCKETS,
    MICRO,
    VOCAB,
    _gpt,
    _my_micro_batches,
    _named_params,
    _train_cfg,
    _train_reference,
    _train_stages,
    zero_engine,
)

# the curves compared with the reference: 2 steps, the second on the first's Adam moments
# (and, at stage 3, on the parameters the first step's shards updated and gathered anew)
STEPS = 2


@pytest.fixture(scope="module")
def reference():
    """Plain torch: TP=1 GPT, torch.optim.AdamW, clip_grad_norm_, the whole global batch."""
    cfg = _train_cfg(1, 1)
    return _train_reference(_gpt(cfg, ParallelState.single()), cfg, STEPS)


VARIANTS: list[tuple[int, dict]] = [
    (0, {}), (1, {}), (2, {}), (3, {}),
    (2, {"overlap_comm": True}),
    (3, {"overlap_comm": True, "zero_param_persistence_threshold": 100})]


# DP 4 (4 shards of every unit, the padding of a shard of 4): the sharded stages, each
# with its own reduction path (stage 1's full buffer, stage 2's overlapped reduce-scatter,
# stage 3's gathers with persistent small params); TP2 x DP2 runs every variant
DP4 = [VARIANTS[1], VARIANTS[4], VARIANTS[5]]


@pytest.mark.parametrize("tp,dp", [(2, 2), (1, 4)])
def test_every_stage_matches_single_process_reference(reference, tp, dp):
    """Losses, clipped grad norms and updated params after STEPS steps, with accumulation
    (TP2xDP2 runs 2 micro-batches per step), buckets smaller than the largest
    parameter (zero_reference.BUCKETS: 4000, the embedding 8192 at TP 2, 12288 at TP 1),
    and stage 3 with and without persistent small params."""
    variants = [(stage, {**BUCKETS, **kw}) for stage, kw in (VARIANTS if dp == 2 else DP4)]
    res = run_ranks(_train_stages, world_size=tp * dp, tp=tp, args=(variants, STEPS))
    _assert_matches_reference(res, reference, variants, tp, dp)


def test_one_process_reduces_without_hooks_and_matches_the_reference(reference):
    """With nothing to reduce (one rank) and gradients accumulated in place, the engine
    registers no gradient hooks (see [Note: no hooks when nothing is reduced]) and still
    trains as plain torch does, accumulation included; stage 2, whose gradients move
    into shards, keeps them."""
    ps = ParallelState.single()
    variants = [(0, {}), (1, {})]
    _assert_matches_reference([_train_stages(ps, variants, STEPS)], reference, variants, 1, 1)
    for stage, hooked in ((0, False), (1, False), (2, True)):
        cfg = _train_cfg(1, 1, zero_stage=stage)
        reducer = zero_engine(_gpt(cfg, ps), ps, cfg).reducer
        assert reducer.hooked == hooked and bool(reducer._hooks) == hooked, stage


def _assert_matches_reference(res, reference, variants, tp, dp):
    for v, (stage, kw) in enumerate(variants):
        what = f"stage {stage} {kw} TP{tp}xDP{dp}"
        got = res[0][v]
        assert len(got["losses"]) == len(reference["losses"]) == STEPS, what
        for a, b in zip(got["losses"], reference["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), f"{what}: loss {a} vs {b}"
        for a, b in zip(got["norms"], reference["norms"]):
            assert abs(a - b) <= 1e-5 * abs(b), f"{what}: grad norm {a} vs {b}"
        for name, ref in reference["params"].items():
            spec = got["specs"][name]
            if spec is None:
                full = got["params"][name]
            else:  # this TP rank's slices live on the first DP replica's ranks 0..tp-1
                full = torch.cat([res[r][v]["params"][name] for r in range(tp)], dim=spec.dim)
            want = ref
            if name == "wte.weight":
                full, want = full[:VOCAB], ref[:VOCAB]
            torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, what=what, name=name: f"{what}: {name}: {m}")
        for r in range(1, tp * dp):  # every DP replica ends with the same params
            for name, t in res[r][v]["params"].items():
                assert torch.equal(t, res[r % tp][v]["params"][name]), f"{what}: {name} r{r}"
                if got["specs"][name] is None:  # and TP replicas of replicated ones too:
                    # a clip coefficient one ulp apart would make them drift apart
                    assert torch.equal(t, got["params"][name]), f"{what}: {name} r{r} vs r0"
            assert res[r][v]["norms"] == got["norms"], f"{what}: grad norms r{r} vs r0"


def _bytes_per_stage(ps, flags, micro_batches=1):
    """Per stage: Psi, model-state bytes after a step, and bytes moved by one step of
    ``micro_batches`` micro-batches (counted by hybrid/parallel/comm.py), by collective kind."""
    out = {}
    for stage in range(4):
        # Buckets of 8192 elements, smaller than the largest parameters (the 24,576-element
        # embedding, the 16,384 and 12,288 of each block's MLP and QKV weights): the bytes
        # asserted do not depend on the bucket (only the rounding allowance, one byte per
        # call, shrinks with it), and a step is half the collectives of 4096's (stage 3,
        # 4 micro-batches: 217, not 397), each a wake-up of 4 ranks on 2 cores.
        cfg = _train_cfg(ps.world_size, 1, zero_stage=stage, hidden_size=64,
                         global_batch_size=ps.dp_size * MICRO * micro_batches,
                         reduce_bucket_size=8192, allgather_bucket_size=8192, **flags)
        model = _gpt(cfg, ps)
        psi = sum(p.numel() for p in model.parameters())
        engine = zero_engine(model, ps, cfg)
        engine.zero_grad()
        batches = [b for s in range(micro_batches) for b in _my_micro_batches(s, ps, MICRO)]
        ps.comm_stats.reset()
        for i, (x, y) in enumerate(batches[:micro_batches]):
            engine.backward(model(x, y) / micro_batches, sync=i == micro_batches - 1)
        engine.step(cfg.lr_schedule.lr)
        out[stage] = {"psi": psi, "padded": sum(u.padded for u in engine.units),
                      "state": engine.model_state_bytes(), "comm": dict(ps.comm_stats.bytes),
                      "calls": dict(ps.comm_stats.calls)}
    return out


def _assert_states_match_estimator(res, dtype, grads_dtype=None, nd=4):
    for stage, r in res.items():
        expect = model_state_bytes(r["psi"], nd, stage, dtype, grads_dtype)
        for what in ("params", "grads", "optimizer"):
            got, e = r["state"][what], expect[what]
            assert abs(got - e) <= 0.02 * e, f"{dtype} stage {stage} {what}: {got} vs {e}"


def test_estimator_is_the_zero_paper_formula():
    psi, nd = 1000, 4
    assert model_state_bytes(psi, nd, 0, "bf16")["total"] == 16 * psi
    assert model_state_bytes(psi, nd, 1, "bf16")["total"] == 4 * psi + 12 * psi // nd
    assert model_state_bytes(psi, nd, 2, "bf16")["total"] == 2 * psi + 14 * psi // nd
    assert model_state_bytes(psi, nd, 3, "bf16")["total"] == 16 * psi // nd
    assert model_state_bytes(psi, nd, 0, "fp32")["total"] == 16 * psi
    # fp32 gradients for bf16 training: g = 4
    assert model_state_bytes(psi, nd, 1, "bf16", "fp32")["total"] == 6 * psi + 12 * psi // nd
    assert model_state_bytes(psi, nd, 3, "bf16", "fp32")["total"] == 18 * psi // nd
    # traffic: stage 2 pays a reduce-scatter per micro-batch, stage 1 one per step
    one = comm_bytes_per_step(psi, nd, 1, 8, "bf16", "fp32")
    two = comm_bytes_per_step(psi, nd, 2, 8, "bf16", "fp32")
    assert one["reduce_scatter"] == 4 * psi * 3 // 4 and two["reduce_scatter"] == 8 * 3 * psi


@pytest.fixture(scope="module")
def bf16_k4():
    """_bytes_per_stage in bf16 (fp32 gradients), TP1 x DP4, a step of 4 micro-batches: one
    run for the state bytes and the communicated bytes of that step."""
    return run_ranks(_bytes_per_stage, world_size=4, tp=1, args=({"bf16": True}, 4))[0]


def test_model_state_bytes_follow_zero_formulas(bf16_k4):
    """bf16 params (2 bytes), fp32 gradients (4: the default with bf16), fp32 master
    + Adam moments (K = 12), measured from the storages alive after a step (of 4
    micro-batches), TP1 x DP4; and bf16 gradients (2) when fp32 accumulation is turned
    off (a step of 1). The estimator's formula must predict them."""
    _assert_states_match_estimator(bf16_k4, "bf16", "fp32")
    res = run_ranks(_bytes_per_stage, world_size=4, tp=1,
                    args=({"bf16": True, "accumulate_allreduce_grads_in_fp32": False},))[0]
    _assert_states_match_estimator(res, "bf16", "bf16")


@pytest.mark.parametrize("k", [1, 4])
def test_communicated_bytes_per_step_equal_the_formula(k, request):
    """TP1 x DP4, k micro-batches per step, fp32 (and bf16 with fp32 gradients at
    k = 4): the bytes each collective kind moves equal ``comm_bytes_per_step`` for
    the padded Psi exactly (up to each call's rounding to whole bytes); the
    all-reduce adds only the grad-norm vector (no overflow flag of its own: the norm
    is the same on every rank, see the engine's [Note: one skip decision])."""
    runs = [("fp32", None, {"overlap_comm": True})]
    if k == 4:
        runs.append(("bf16", "fp32", {"bf16": True}))
    for dtype, grads, flags in runs:
        res = (request.getfixturevalue("bf16_k4") if dtype == "bf16" else
               run_ranks(_bytes_per_stage, world_size=4, tp=1, args=(flags, k))[0])
        if dtype == "fp32":
            _assert_states_match_estimator(res, "fp32")  # K = 8: params are their own master
        nd, f = 4, 3 / 4
        for stage, r in res.items():
            expect = comm_bytes_per_step(r["padded"], nd, stage, k, dtype, grads)
            # the squared norms and the loss's finite flag (fp64 x 3) over DP
            scalars = 2 * 24 * f if stage else 0
            for kind in ("reduce_scatter", "all_gather", "all_reduce"):
                got = r["comm"][kind] - (scalars if kind == "all_reduce" else 0)
                assert abs(got - expect[kind]) <= r["calls"][kind], \
                    f"{dtype} stage {stage} k={k} {kind}: {got} vs {expect[kind]}"
            assert r["padded"] - r["psi"] < nd * 40  # padding: < N per unit


def _largest_messages(ps, hidden):
    out = {}
    for stage in range(4):
        cfg = _train_cfg(ps.world_size, 1, zero_stage=stage, hidden_size=hidden,
                         overlap_comm=stage % 2 == 0)
        model = _gpt(cfg, ps)
        engine = zero_engine(model, ps, cfg)
        ps.comm_stats.reset()
        engine.zero_grad()
        for i, (x, y) in enumerate(_my_micro_batches(0, ps, MICRO)):
            engine.backward(model(x, y), sync=i == 1)
        engine.step(cfg.lr_schedule.lr)
        out[stage] = (dict(ps.comm_stats.max_numel), engine.comm_temp_bytes(),
                      max(p.numel() for p in model.parameters()))
    return out


def test_no_message_exceeds_the_bucket_whatever_the_model_size():
    # hidden 32 and 64: the larger's embedding (24,576 elements) is over 24 buckets, its
    # every matrix 4 times the smaller's (a larger model only adds more such pieces)
    small, large = run_ranks(_largest_messages, world_size=2, tp=1, args=(32,))[0], \
        run_ranks(_largest_messages, world_size=2, tp=1, args=(64,))[0]
    bucket = 1000
    for stage in range(4):
        for res in (small, large):
            biggest_message, temp_bytes, biggest_param = res[stage]
            assert max(biggest_message.values()) <= bucket, (stage, biggest_message)
            # two reusable staging buffers each for reductions and for gathers
            assert temp_bytes["reduce"] <= 2 * bucket * 4 and temp_bytes["gather"] <= 2 * bucket * 4
        assert large[stage][2] > 10 * bucket  # the big model really has big params
        for kind in ("reduce", "gather"):
            assert large[stage][1][kind] <= max(small[stage][1][kind], 2 * bucket * 4)


def _overflow(ps):
    cfg = _train_cfg(ps.world_size, 1, zero_stage=2, fp16=True, hysteresis=1,
                     initial_loss_scale=1024.0)
    model = _gpt(cfg, ps)
    engine = zero_engine(model, ps, cfg)
    steps = []
    for step in range(2):
        engine.zero_grad()
        for i, (x, y) in enumerate(_my_micro_batches(step, ps, MICRO)):
            engine.backward(model(x, y) / 2, sync=i == 1)
        if step == 1 and ps.rank == 1:  # an inf in one rank's gradient shard only
            engine.units[0].grad_shard[0] = float("inf")
        before = _named_params(model, engine)
        master_before = [m.clone() for m in engine.optimizer.master]
        result = engine.step(cfg.lr_schedule.lr)
        after = _named_params(model, engine)
        flag = result.skipped  # a 0-dim bool tensor, also when the host decided (fp16)
        assert flag.dtype == torch.bool and flag.dim() == 0 and flag.device == ps.device
        assert result.host_skipped == bool(flag)
        steps.append({"skipped": bool(flag), "scale": result.loss_scale,
                      "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                      "master_unchanged": all(torch.equal(a, b) for a, b in
                                              zip(master_before, engine.optimizer.master))})
    return steps


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    res = run_ranks(_overflow, world_size=2, tp=1)
    for rank_steps in res:
        first, second = rank_steps
        assert not first["skipped"] and first["scale"] == 1024.0 and not first["unchanged"]
        assert second["skipped"] and second["scale"] == 512.0
        assert second["unchanged"] and second["master_unchanged"]


# buckets of 4000 (BUCKETS, as test_every_stage_matches_single_process_reference): what
# offload moves per unit does not depend on the bucket, and the embedding is still a unit
# of its own larger than one
OFFLOAD: list[tuple[int, dict]] = [(stage, {"offload_optimizer": True, **BUCKETS})
                                   for stage in (1, 2, 3)]


def _cpu_adam_loaded(ps):
    """(kernels off in this worker's settings, the compiled CPU Adam step loaded)."""
    from hybrid.kernels import current
    from hybrid.kernels.adam import cpu_adam_ext
    return current().no_kernels, cpu_adam_ext() is not None


def test_offload_optimizer_stages_1_to_3_match_the_reference(reference):
    """ZeRO-Offload (host master + moments, the fused CPU step, grads down and
    params up through host buffers) gives the reference's losses, norms and
    parameters at stages 1-3 with the compiled kernel. (Its PyTorch fallback gives the
    kernel's numbers: tests/kernels/test_kernels_adam.py; HYBRID_NO_KERNELS choosing it:
    test_no_kernels_forces_the_fallback.)"""
    res = run_ranks(_train_stages, world_size=2, tp=1, args=(OFFLOAD, STEPS))
    _assert_matches_reference(res, reference, OFFLOAD, 1, 2)
    off, loaded = run_ranks(_cpu_adam_loaded, world_size=2, tp=1)[0]
    assert not off
    if shutil.which("c++") or shutil.which("g++"):  # no compiler: no kernel either way
        assert loaded


def test_offload_optimizer_in_bf16_equals_the_device_optimizer():
    """bf16 model: the offloaded step (bf16 grads down, bf16 params up, one fused
    pass on the host) follows the non-offloaded bf16 run's loss curve."""
    variants = [(s, {"bf16": True, **BUCKETS, **kw}) for s in (1, 3)
                for kw in ({}, {"offload_optimizer": True})]
    res = run_ranks(_train_stages, world_size=2, tp=1, args=(variants,))
    runs = res[0]
    for plain, offloaded in ((runs[0], runs[1]), (runs[2], runs[3])):
        for a, b in zip(offloaded["losses"], plain["losses"]):
            assert abs(a - b) <= 1e-4 * abs(b), (a, b)
        assert offloaded["losses"][-1] < offloaded["losses"][0]


class _Squares:
    """An optimizer stand-in: this rank's [split, replicated] squared norms."""

    def __init__(self, split, replicated):
        self.values = torch.tensor([split, replicated], dtype=torch.float64)

    def squared_norms(self, grads):
        return self.values.clone()


def _norm_and_flag(ps, bad_rank):
    from hybrid.zero.optimizer import global_grad_norm
    # split parts differ on every rank (summed over the world); replicated ones differ
    # over DP only (TP ranks hold the same copy, counted once)
    opt = _Squares(1.0 + ps.rank, 10.0 * (1 + ps.dp_rank))
    out = {}
    for flagged in (False, True):  # rank bad_rank's loss is infinite, or not
        loss = torch.tensor(float("inf") if flagged and ps.rank == bad_rank else 1.0)
        for stage, dp in ((1, ps.dp_group), (0, None)):
            ps.comm_stats.reset()
            norm, bad = global_grad_norm(opt, [torch.zeros(1)], ps.tp_group, dp, loss,
                                         ps.dp_cp_group)
            out[(stage, flagged)] = (float(norm), bool(bad), ps.comm_stats.calls["all_reduce"])
    return out


def test_loss_flag_rides_in_the_norm_all_reduce():
    """TP 2 x DP 2: one rank's infinite loss is seen by every rank, in the norm's own
    all-reduces (DP then TP), and at stage 0 in a TP plus a DP one; the norm is
    unchanged by it (stage >= 1: split parts summed over the world, replicated over DP)."""
    for rank, res in enumerate(run_ranks(_norm_and_flag, world_size=4, tp=2, args=(3,))):
        want = (sum(1.0 + r for r in range(4)) + 10.0 + 20.0) ** 0.5
        for (stage, told), (norm, bad, calls) in res.items():
            assert calls == 2, (rank, stage)  # never a world all-reduce of its own
            if stage:
                assert norm == pytest.approx(want)
            assert bad == told, (rank, stage, told)


def _pipeline_norms(ps):
    from hybrid.zero.optimizer import global_grad_norm
    # stage s holds split squares 1 + s and replicated squares 10 * (1 + s); on stage 1 a
    # last case makes its replicated part non-finite
    out = {}
    for counted in (True, False):
        for poisoned in (False, True):
            rep = float("inf") if poisoned and ps.pp_rank == 1 else 10.0 * (1 + ps.pp_rank)
            opt = _Squares(1.0 + ps.pp_rank, rep)
            norm, bad = global_grad_norm(opt, [torch.zeros(1)], ps.tp_group, None,
                                         pp=ps.pp_group,
                                         count_replicated=counted or ps.pp_rank == 0)
            out[(counted, poisoned)] = (float(norm), bool(bad))
    return out


def test_deepspeed_s_pipeline_norm_counts_the_first_stage_s_replicated_gradients():
    """PP 2: the whole model's norm sums both stages; DeepSpeed's pipeline norm
    (AdamWConfig.clip_norm_of "first_stage": a stage after the first leaves its replicated
    parameters out) is sqrt(split of both + the first stage's replicated), the same on
    both stages; a non-finite gradient left out of it still flags the step everywhere."""
    for res in run_ranks(_pipeline_norms, world_size=2, pp=2):
        assert res[(True, False)] == (pytest.approx((1 + 2 + 10 + 20) ** 0.5), False)
        assert res[(False, False)] == (pytest.approx((1 + 2 + 10) ** 0.5), False)
        # (counted, the norm itself is not finite: the engine's skip reads both)
        assert res[(False, True)][1] is True and res[(True, True)][0] == float("inf")


def test_squared_norm_holds_its_digits_however_long_the_range():
    """The norm's squared sums (hybrid.zero.optimizer.squared_norm) against fp64: within
    1e-6 relative at 5M elements of a heavy-tailed gradient (one fp32 norm: 2e-4), for
    fp32 and bf16 ranges, whole rows and a ragged tail alike; the same bits twice."""
    from hybrid.zero.optimizer import NORM_BLOCK, squared_norm
    g = torch.Generator().manual_seed(0)
    n = 5_000_000 + NORM_BLOCK // 3
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    for t in (x, x.bfloat16(), x[: NORM_BLOCK - 1], x[:0]):
        want = t.double().square().sum()
        got = squared_norm(t)
        assert got.dtype == torch.float64 and got.shape == ()
        assert abs(got - want) <= 1e-6 * want, (t.dtype, t.numel(), got, want)
        assert torch.equal(got, squared_norm(t))
