"""The pipeline's proof grid: every schedule at PP 4 against one pipeline stage, with each
thing the pipeline composes with, through scripts/pretrain_gpt.py's work (on pooled
ranks, :func:`tests.helpers.launch.pretrain`).

    python -m tests.pipeline.proof_grid [--only SCHEDULE_OR_FEATURE ...]

A cell is a schedule (GPipe, 1F1B, ZB-H1 on a 4-layer GPT, one layer a stage;
interleaved 1F1B on an 8-layer one, two one-layer chunks a stage) times a feature
(:data:`FEATURES`: DP 2 at ZeRO 0-3, ZeRO 3 resharding after every micro-batch, TP 2
with SP, ZeRO-R's partitioned checkpoints, CP 2, selective and full recompute, the host
and NVMe offload tiers, bf16, fp16). Its reference is PP 1 with the same feature and
layers, on the ranks the pipeline leaves (a quarter). Every cell trains 3 steps of the
same global batches (4 micro-batches a pipeline, as many as stages: :func:`global_batch`)
and evaluates once; it passes when every step's loss and grad norm and the validation
loss are within :data:`TOLERANCE` (relative) of its reference's (:data:`LOOSER` in half
precision). Each cell is one JSON line (the largest relative differences seen); the
exit status is the number of failed cells (0: all held). tests/pipeline/test_proof_grid.py
runs four of its cells in the suite; the whole grid is this command.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass

from tests.helpers.launch import TINY, pretrain, read_json_log

TOLERANCE = 1e-5
SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved")
PP4 = ["--pipeline-model-parallel-size", "4"]
DP2 = 2  # the world size of a DP 2 / TP 2 / CP 2 reference

# feature -> (reference world size, flags besides the pipeline's); "{nvme}" is the
# cell's own swap directory; flags after PP_ONLY are the pipeline run's alone
PP_ONLY = "--"
FEATURES: dict[str, tuple[int, list[str]]] = {
    "zero0": (DP2, ["--zero-stage", "0"]),
    "zero1": (DP2, ["--zero-stage", "1"]),
    "zero2": (DP2, ["--zero-stage", "2", "--overlap-grad-reduce"]),
    "zero3": (DP2, ["--zero-stage", "3"]),
    "zero3_reshard": (DP2, ["--zero-stage", "3", PP_ONLY,
                            "--pipeline-reshard-after-micro-batch"]),
    "tp2_sp": (DP2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2_partitioned": (DP2, ["--tensor-model-parallel-size", "2", "--recompute-granularity",
                              "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "1", "--partition-activations"]),
    "cp2": (DP2, ["--context-parallel-size", "2"]),
    "recompute_selective": (DP2, ["--recompute-granularity", "selective"]),
    "recompute_full": (DP2, ["--recompute-granularity", "full", "--recompute-method",
                             "uniform", "--recompute-num-layers", "1"]),
    "host": (DP2, ["--zero-stage", "2", "--offload-optimizer", "cpu"]),
    "host_param": (DP2, ["--zero-stage", "3", "--offload-optimizer", "cpu",
                         "--offload-param", "cpu"]),
    # (tiles of 64Ki elements: the shards stream through several, and each unit's staging
    # buffers and swap file stay near its size -- at the default 8Mi elements every unit,
    # however small, zeroes and writes 96 MiB a tile: 4 s of the cell's 5 on 2 cores)
    "nvme": (DP2, ["--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-param",
                   "nvme", "--offload-nvme-path", "{nvme}", "--offload-buffer-size", "65536"]),
    "bf16": (DP2, ["--bf16", "--zero-stage", "1"]),
    "fp16": (DP2, ["--fp16", "--zero-stage", "3"]),
}
# Half precision keeps 8 (bf16) or 11 (fp16) significant bits. One process sums the tied
# embedding's two gradients in the model's dtype inside autograd, the pipeline in fp32
# across the first and last stage: at bf16 the norms part by up to 5e-4 from the first
# step (untied, 7e-5). And a last-bit difference in the norm moves the clip coefficient,
# which flips the bf16 rounding of a few parameters: the next losses part by ~1e-5.
LOOSER = {"bf16": 1e-3, "fp16": 3e-4}


@dataclass(frozen=True)
class Cell:
    schedule: str
    feature: str

    @property
    def layers(self) -> int:
        return 8 if self.schedule == "interleaved" else 4

    def pipeline_flags(self) -> list[str]:
        if self.schedule == "interleaved":
            return PP4 + ["--virtual-pipeline-model-parallel-size", "2"]
        return PP4 + ["--pipeline-schedule", self.schedule]


def cells(only: list[str] | None = None) -> list[Cell]:
    """Every (schedule, feature), or those naming one of ``only``."""
    out = [Cell(s, f) for s in SCHEDULES for f in FEATURES]
    return [c for c in out if not only or c.schedule in only or c.feature in only]


def global_batch(flags: list[str]) -> int:
    """4 micro-batches of 2 a pipeline (m = p) in every cell: 16 samples at DP 2, 8 where
    TP 2 or CP 2 hold the other half of the ranks (DP 1)."""
    return 8 if {"--tensor-model-parallel-size", "--context-parallel-size"} & set(flags) else 16


def _train(n: int, layers: int, flags: list[str], workdir: str, name: str,
           common: tuple[str, ...] = ()):
    """(training records, validation records) of one run, or raises naming it;
    ``common``: flags after the grid's own (they override them)."""
    path = f"{workdir}/{name}.jsonl"
    args = [a for a in TINY]
    args[args.index("--num-layers") + 1] = str(layers)
    flags = [f.replace("{nvme}", f"{workdir}/{name}.nvme") for f in flags]
    r = pretrain(n, args + ["--global-batch-size", str(global_batch(flags)),
                            "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1",
                            "--log-json", path, *common] + flags)
    if r.returncode != 0:
        raise AssertionError(f"{name} (exit {r.returncode}):\n{r.stdout[-2000:]}\n"
                             f"{r.stderr[-3000:]}")
    return read_json_log(path), read_json_log(path, "valid")


def differences(ran, ref) -> dict:
    """The largest relative differences of ``ran``'s losses, grad norms and validation
    loss from ``ref``'s (each a :func:`_train` result); raises if the records differ in
    number."""
    (log, valid), (ref_log, ref_valid) = ran, ref
    if len(log) != len(ref_log) or len(valid) != len(ref_valid) or not log or not valid:
        raise AssertionError(f"{len(log)} steps, {len(valid)} evaluations; the reference "
                             f"{len(ref_log)}, {len(ref_valid)}")
    rel = {key: max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(log, ref_log))
           for key in ("loss", "grad_norm")}
    rel["valid_loss"] = abs(valid[0]["loss"] - ref_valid[0]["loss"]) / abs(ref_valid[0]["loss"])
    return rel


def run(grid: list[Cell], workdir: str, out=sys.stdout,
        common: tuple[str, ...] = ()) -> list[dict]:
    """Run ``grid`` (references first, each once), one JSON line per cell on ``out``;
    ``common``: flags in every run, the references' too (after the grid's own)."""
    refs = {}
    results = []
    for cell in grid:
        n, flags = FEATURES[cell.feature]
        both = flags[: flags.index(PP_ONLY)] if PP_ONLY in flags else flags
        key = (cell.feature, cell.layers)
        if key not in refs:
            refs[key] = _train(n, cell.layers, both, workdir,
                               f"ref_{cell.feature}_{cell.layers}", common)
        t = time.perf_counter()
        ran = _train(4 * n, cell.layers,
                     cell.pipeline_flags() + [f for f in flags if f != PP_ONLY], workdir,
                     f"{cell.schedule}_{cell.feature}", common)
        rel = differences(ran, refs[key])
        line = {"schedule": cell.schedule, "feature": cell.feature, "world": 4 * n,
                "layers": cell.layers, **{k: float(f"{v:.3g}") for k, v in rel.items()},
                "ok": max(rel.values()) <= LOOSER.get(cell.feature, TOLERANCE),
                "seconds": round(time.perf_counter() - t, 2)}
        results.append(line)
        print(json.dumps(line), file=out, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None,
                        help=f"schedules ({', '.join(SCHEDULES)}) or features "
                             f"({', '.join(FEATURES)}) to run; all by default")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        results = run(cells(args.only), workdir)
    failed = [r for r in results if not r["ok"]]
    print(json.dumps({"cells": len(results), "failed": len(failed),
                      "worst": max((max(r["loss"], r["grad_norm"], r["valid_loss"])
                                    for r in results), default=0.0)}))
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
