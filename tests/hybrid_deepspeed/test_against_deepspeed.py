"""The DeepSpeed-style scripts of ``tests/hybrid_deepspeed/cases/`` under ``hybrid.deepspeed``,
compared with DeepSpeed 0.19.8's own run of the same scripts (recorded on the CPU at 2
ranks by ``python -m tests.hybrid_deepspeed.record_deepspeed`` into ``recorded/``): every
rank's loss of every micro-batch, the learning rate every optimizer step applies, and
each case's extra numbers, equal within 1e-5 (fp32).

All the cases run in one pooled 2-rank call (DP 2), and the pipeline cases
(:mod:`tests.hybrid_deepspeed.cases.pipe`, ``stages`` 2) in another, laid out PP 2. A case
hybrid does not match yet is
in :data:`PENDING` with the reason: it is reported as skipped, and
:func:`test_pending_cases_still_fail_under_hybrid` fails as soon as one of them
matches, so the suite says when to move it out.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers.harness import run_ranks
from tests.hybrid_deepspeed.cases import CASES, on_ranks
from tests.hybrid_deepspeed.cases.common import SEED, SimpleModel
from tests.hybrid_deepspeed.record_deepspeed import RECORDED, WORLD_SIZE

TOLERANCE = 1e-5

# case -> why hybrid does not match DeepSpeed on it yet (what hybrid does instead)
PENDING: dict[str, str] = {}


def _recorded(name: str) -> dict:
    with open(RECORDED / f"{name}.json") as f:
        return json.load(f)


def _differences(got: list[float], want: list[float]) -> str | None:
    """None when ``got`` equals ``want`` within the tolerance, else what differs."""
    if len(got) != len(want):
        return f"{len(got)} values, DeepSpeed {len(want)}"
    worst = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    if math.isnan(worst) or worst > TOLERANCE:
        return f"max |difference| {worst:.3g}"
    return None


# [Note: where DeepSpeed differs from itself] A parameter used in some micro-batches of an
# accumulation window and not others (unused_parameters' "sometimes" layer, the second of
# each window): DeepSpeed 0.19.8 trains it alike at ZeRO 0, 1 and 2, but at ZeRO 3 and with
# the optimizer on the host or on NVMe its numbers leave those from the second step on, the
# global norm growing step after step (3.77, 4.96, 6.44, 7.46 against 3.77, 3.62, 3.80,
# 3.24; not traced further here). hybrid gives stage 0-2's numbers at every stage and tier:
# those cases are held to the stage-2 recording, and their own recordings are kept, and
# checked below to still differ.
# Two engine.backward calls before one step (DeepSpeedExamples' GAN) differ the same way:
# DeepSpeed's stages 0 and 3 apply both micro-batches' DP-mean gradients, its stages 1 and
# 2 other numbers from the second step on (and equal to each other); hybrid gives stage
# 0's at every stage.
AGAINST = {"unused_parameters_stage3": "unused_parameters",
           "unused_parameters_offload": "unused_parameters",
           "unused_parameters_offload_param": "unused_parameters",
           "unused_parameters_nvme": "unused_parameters",
           "two_backwards_stage1": "two_backwards_stage0",
           "two_backwards_stage2": "two_backwards_stage0"}


def _problems(name: str, ranks: list[dict]) -> list[str]:
    """What differs between hybrid's run of case ``name`` (each rank's result) and
    DeepSpeed's recording (of the case :data:`AGAINST` names for it); empty when they
    agree."""
    out = []
    recorded = _recorded(AGAINST.get(name, name))["ranks"]
    for rank, (got, want) in enumerate(zip(ranks, recorded, strict=True)):
        if "error" in got:
            return [f"rank {rank}: {got['error']}"]
        pairs = [("losses", got["losses"], want["losses"]), ("lrs", got["lrs"], want["lrs"])]
        pairs += [(f"extra {k}", got["extra"].get(k, []), v) for k, v in want["extra"].items()]
        for what, g, w in pairs:
            diff = _differences(g, w)
            if diff is not None:
                out.append(f"rank {rank} {what}: {diff}\n  hybrid    {g}\n  DeepSpeed {w}")
    return out


@pytest.fixture(scope="module")
def under_hybrid(tmp_path_factory) -> dict[str, list[dict]]:
    """Every case under hybrid.deepspeed, one pooled 2-rank call per layout (DP 2; the
    pipeline cases' PP 2): case -> rank results."""
    out = {}
    for stages in sorted({c.stages for c in CASES.values()}):
        names = [n for n, c in CASES.items() if c.stages == stages]
        by_rank = run_ranks(on_ranks, world_size=WORLD_SIZE, pp=stages,
                            args=(names, str(tmp_path_factory.mktemp(f"cases_pp{stages}"))))
        out.update({name: [r[name] for r in by_rank] for name in names})
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_script_trains_under_hybrid_as_under_deepspeed(name, under_hybrid):
    if name in PENDING:
        pytest.skip(f"pending: {PENDING[name]}")
    problems = _problems(name, under_hybrid[name])
    assert not problems, f"{name} ({CASES[name].doc}):\n" + "\n".join(problems)


def test_deepspeed_differs_from_itself_on_a_parameter_used_in_part_of_a_window():
    """The recordings behind AGAINST (the Note above): DeepSpeed's first step equals the
    run it is held to, and later steps do not; the stages named alike agree."""
    for name, against in AGAINST.items():
        ranks, theirs = _recorded(name)["ranks"][0], _recorded(against)["ranks"][0]
        assert ranks["losses"][:2] == theirs["losses"][:2], name
        assert _differences(ranks["losses"], theirs["losses"]) is not None, name
    same = (("unused_parameters_stage0", "unused_parameters"),
            ("unused_parameters_stage1", "unused_parameters"),
            ("two_backwards_stage3", "two_backwards_stage0"))
    for name, against in same:
        assert _differences(_recorded(name)["ranks"][0]["losses"],
                            _recorded(against)["ranks"][0]["losses"]) is None, name


def test_every_stage_of_a_pipeline_returns_the_same(under_hybrid):
    """Under hybrid too, train_batch's loss is the same on both stages, bit for bit, and
    so is the tied weight of pipeline_tied: the first and the last stage's copies stay
    identical."""
    for name, case in CASES.items():
        if case.stages > 1:
            first, last = under_hybrid[name]
            assert first == last, name
    assert len(under_hybrid["pipeline_tied"][0]["extra"]["tied_weight"]) == 16 * 8


def test_pending_cases_still_fail_under_hybrid(under_hybrid):
    """A pending case that now matches DeepSpeed is a case to move out of PENDING."""
    matching = [name for name in PENDING if not _problems(name, under_hybrid[name])]
    assert not matching, (f"these cases now match DeepSpeed under hybrid: take them out of "
                          f"PENDING in {__file__}: {matching}")


def test_every_case_is_recorded_as_it_is_written_now():
    """The recording is of the scripts in the tree: each case has its file, with the
    case's current ds_config and docstring (change one: rerun the recorder), and no
    file is left of a case that is gone; the pending reasons name cases."""
    assert set(PENDING) <= set(CASES), set(PENDING) - set(CASES)
    files = {p.stem for p in RECORDED.glob("*.json")}
    assert files == set(CASES), (f"missing: {set(CASES) - files}, "
                                 f"stale: {files - set(CASES)}")
    for name, case in CASES.items():
        rec = _recorded(name)
        assert rec["config"] == case.config and rec["script"] == case.doc, (
            f"{name} changed since it was recorded: "
            f"python -m tests.hybrid_deepspeed.record_deepspeed")
        assert rec["versions"]["deepspeed"] == "0.19.8" and rec["world_size"] == WORLD_SIZE
        if case.stages == 1:  # DP 2 split the data: the ranks trained on different batches
            assert rec["ranks"][0]["losses"] != rec["ranks"][1]["losses"], name
        else:  # one pipeline: train_batch's loss is the same on every stage
            assert rec["ranks"][0] == rec["ranks"][1], name


def test_the_recorded_cases_exercise_what_they_name():
    """Guards on DeepSpeed's numbers themselves, so a case cannot pass by not doing what
    it says: the clip cuts the spiked first step only; the schedules move the rate; the
    checkpoint resumes the saved run exactly and brings rank 0's tensor back; the frozen
    layer stays as built; the constructor's init is kept; the loader's batches are
    DistributedSampler's share."""
    clip = CASES["clipping"].config["gradient_clipping"]
    norms = _recorded("clipping")["ranks"][0]["extra"]["grad_norm"]
    assert norms[0] > 5 * clip and max(norms[1:]) < clip, norms
    for name in ("warmup_lr", "warmup_decay_lr", "warmup_cosine_lr", "one_cycle",
                 "lr_range_test", "transformers_schedule", "checkpoint_tag"):
        assert len(set(_recorded(name)["ranks"][0]["lrs"])) >= 4, name
    ckpt = _recorded("checkpoint_tag")["ranks"]
    for rank in ckpt:
        assert rank["extra"]["resumed_losses"] == rank["losses"][3:]
        assert rank["extra"]["resumed_lrs"] == rank["lrs"][3:]
        assert rank["extra"]["client_mean_loss"] == [pytest.approx(sum(ckpt[0]["losses"][:3]) / 3)]
    torch.manual_seed(SEED)
    initial = SimpleModel().fc1
    for rank in _recorded("frozen")["ranks"]:  # the frozen layer kept its initial values
        assert rank["extra"]["frozen_sum"] == [float(initial.weight.detach().sum()),
                                               float(initial.bias.detach().sum())]
    # the constructor's own init was kept: the first loss is not the default init's
    assert (abs(_recorded("zero_init_constructor")["ranks"][0]["losses"][0]
                - _recorded("zero1")["ranks"][0]["losses"][0]) > 0.1)
    for rank in _recorded("training_data")["ranks"]:  # 14 samples a rank, two epochs
        assert rank["extra"]["batch_sizes"] == [4, 4, 4, 2] * 2
