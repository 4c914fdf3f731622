"""Mixed precision through the pipeline, through scripts/pretrain_gpt.py (its work on
pooled ranks): with fp16 a non-finite gradient on one rank of one stage skips the step
on every rank of every stage, and the loss scale follows one process's; bf16 follows
PP 1's curve."""

import json
import math
from pathlib import Path

from tests.helpers.launch import TINY, pretrain, pretrain_rank_with, read_json_log

COMMON = TINY + ["--global-batch-size", "8", "--train-iters", "4", "--eval-iters", "0",
                 "--initial-loss-scale", "1024", "--hysteresis", "1"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _poison_step_two(ps, cfg):
    """_pretrain_rank, with the gradient of the rank named in the --log-json file's name
    (``...pp<stage>dp<dp rank>.jsonl``) made NaN at its second step, just before the
    step reads it; records per step whether this rank poisoned it."""
    from hybrid.zero import ZeroEngine
    orig = ZeroEngine.step
    stem = cfg.logging.log_json.rsplit("pp", 1)[1].split(".")[0]
    target = tuple(int(x) for x in stem.split("dp"))
    poisoned = []

    def step(self, *args, **kwargs):
        hit = len(poisoned) == 1 and (ps.pp_rank, ps.dp_rank) == target
        if hit:
            shard = next(u.grad_shard for u in self.units
                         if u.grad_shard is not None and u.grad_shard.numel())
            shard[0] = math.nan
        poisoned.append(hit)
        return orig(self, *args, **kwargs)

    return pretrain_rank_with(ps, cfg, ZeroEngine, "step", step, "poisoned", lambda: poisoned)


def test_an_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(tmp_path):
    """fp16 at ZeRO 1, a NaN in step 2's reduced gradient shard on one rank of the world:
    at PP 2 x DP 2 under 1F1B on the first stage (the stage whose backward ends last) and
    under ZB-H1 on the last, and at PP 1 x DP 2 on DP rank 1. Every run skips step 2 (one skipped
    iteration, the scale 1024 -> 512, a non-finite norm) and only then; every other
    step's loss and grad norm are within 5e-5 (fp16) of PP 1's, the loss scale the same
    at every step; the poison was applied once, on the one rank named."""
    runs = {"pp0dp1": (2, []),
            "pp0dp0": (4, PP2),
            "pp1dp0": (4, PP2 + ["--pipeline-schedule", "zb_h1"])}
    logs = {}
    for name, (n, extra) in runs.items():
        path = str(tmp_path / f"fp16_{name}.jsonl")
        r = pretrain(n, COMMON + ["--fp16", "--zero-stage", "1", "--log-json", path] + extra,
                     rank_fn=_poison_step_two)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        logs[name] = read_json_log(path)
        hits = [rank for rank in range(n)
                if any(json.loads(Path(f"{path}.poisoned{rank}").read_text()))]
        assert len(hits) == 1, (name, hits)
    ref = logs["pp0dp1"]
    for name, log in logs.items():
        assert [d["skipped_iterations"] for d in log] == [0, 1, 1, 1], (name, log)
        assert [d["loss_scale"] for d in log] == [d["loss_scale"] for d in ref], name
        assert log[0]["loss_scale"] == 1024 and log[1]["loss_scale"] == 512, (name, log)
        assert not math.isfinite(log[1]["grad_norm"]), (name, log[1])
        for i in (0, 2, 3):
            for key in ("loss", "grad_norm"):
                a, b = log[i][key], ref[i][key]
                assert abs(a - b) <= 5e-5 * abs(b), (name, i, key, a, b)


def test_bf16_stages_follow_the_one_stage_curve(tmp_path):
    """bf16 at PP 2 x DP 2 under ZB-H1 at ZeRO 3 against PP 1 x DP 2: every step's loss
    within 5e-5 and grad norm within 2e-4, relative (bf16; the tied embedding's two
    gradients are summed in fp32 across the stages, in the model dtype inside one)."""
    logs = {}
    for name, (n, extra) in {"pp1": (2, []),
                             "pp2": (4, PP2 + ["--pipeline-schedule", "zb_h1",
                                               "--zero-stage", "3"])}.items():
        path = str(tmp_path / f"bf16_{name}.jsonl")
        r = pretrain(n, COMMON + ["--bf16", "--log-json", path] + extra)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        logs[name] = read_json_log(path)
    assert len(logs["pp2"]) == len(logs["pp1"]) == 4
    for i, (a, b) in enumerate(zip(logs["pp2"], logs["pp1"])):
        assert a["skipped_iterations"] == b["skipped_iterations"] == 0, (i, a, b)
        assert abs(a["loss"] - b["loss"]) <= 5e-5 * b["loss"], (i, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-4 * b["grad_norm"], (i, a, b)
