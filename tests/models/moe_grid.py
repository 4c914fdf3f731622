"""The MoE layout grid: a GPT with MoE layers trained at each layout hybrid runs MoE at,
against one process, through scripts/pretrain_gpt.py's work (on pooled ranks,
:func:`tests.helpers.launch.pretrain`).

    python -m tests.models.moe_grid [--only CELL ...]

The model: 4 layers, a dense first one and then MoE and dense in turn
(``--moe-layer-freq "([0]+[1])*2"``), 4 experts of which each token takes 2, a shared
expert behind its sigmoid gate (``--moe-shared-expert-gate``), the load-balancing loss
at 0.5 and the z-loss at 0.1 (large, so that a wrong gradient of theirs shows in the
norm). Every cell trains 3 steps of the same global
batches (8 samples, micro-batches of 2: 4 micro-batches on one process, 2 a rank at DP
2) and evaluates once; it passes when every step's loss and grad norm, the validation
loss and each MoE layer's logged aux and z losses are within :data:`TOLERANCE`
(relative) of the reference's, and its tokens per expert (fewest and most per step) and
dropped assignments are the same numbers. A cell of its own flags (``capacity``,
``seq_aux_loss``) has a reference with those flags. Each cell is one JSON line; the
exit status is the number of failed cells. tests/models/test_moe_grid.py runs
:data:`DIAGONAL` in the suite; the whole grid is this command.

What the cells show is that the routing losses and statistics are layout-free:
whatever DP size (so micro-batches a rank), ZeRO stage, offload tier, pipeline schedule
or recompute, each micro-batch of 2 sequences gives the same losses and the same
gradient ([Note: the MoE losses' gradient] in models/moe.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from tests.helpers.launch import TINY, pretrain, read_json_log

TOLERANCE = 1e-5
MOE = ["--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-layer-freq", "([0]+[1])*2", "--moe-shared-expert-intermediate-size", "32",
       "--moe-shared-expert-gate",
       "--moe-aux-loss-coeff", "0.5", "--moe-z-loss-coeff", "0.1", "--global-batch-size", "8",
       "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]
GLOBAL = ["--moe-router-load-balancing-type", "global_aux_loss"]
# cell -> (world size, flags, reference flags: the same on one process)
CELLS: dict[str, tuple[int, list[str], list[str]]] = {
    "dp2_zero0": (2, ["--zero-stage", "0"], []),
    "dp2_zero1": (2, ["--zero-stage", "1"], []),
    "dp2_zero2": (2, ["--zero-stage", "2", "--overlap-grad-reduce"], []),
    "dp2_zero3": (2, ["--zero-stage", "3"], []),
    "dp4_zero3": (4, ["--zero-stage", "3"], []),
    "dp2_host": (2, ["--zero-stage", "2", "--offload-optimizer", "cpu"], []),
    "dp2_host_param": (2, ["--zero-stage", "3", "--offload-optimizer", "cpu",
                           "--offload-param", "cpu"], []),
    "dp2_nvme": (2, ["--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-param",
                     "nvme", "--offload-nvme-path", "{nvme}", "--offload-buffer-size", "65536"],
                 []),
    "pp2_gpipe": (2, PP2 + ["--pipeline-schedule", "gpipe"], []),
    "pp2_1f1b": (2, PP2 + ["--pipeline-schedule", "1f1b"], []),
    "pp2_zb_h1": (2, PP2 + ["--pipeline-schedule", "zb_h1"], []),
    "pp2_interleaved": (2, PP2 + ["--virtual-pipeline-model-parallel-size", "2"], []),
    "pp2_dp2_zero1": (4, PP2 + ["--zero-stage", "1"], []),
    "recompute_full": (2, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "2"], []),
    "recompute_selective": (1, ["--recompute-granularity", "selective"], []),
    "capacity": (2, ["--moe-expert-capacity-factor", "0.75"],
                 ["--moe-expert-capacity-factor", "0.75"]),
    "seq_aux_loss": (2, ["--moe-router-load-balancing-type", "seq_aux_loss"],
                     ["--moe-router-load-balancing-type", "seq_aux_loss"]),
    # experts split over EP: their gradients reduced and sharded over the expert DP group
    "ep2_zero0": (2, ["--expert-model-parallel-size", "2", "--zero-stage", "0"], []),
    "ep2_zero1": (2, ["--expert-model-parallel-size", "2", "--zero-stage", "1"], []),
    "ep2_zero2": (2, ["--expert-model-parallel-size", "2", "--zero-stage", "2",
                      "--overlap-grad-reduce"], []),
    "ep2_zero3": (2, ["--expert-model-parallel-size", "2", "--zero-stage", "3"], []),
    "dp4_ep2_zero3": (4, ["--expert-model-parallel-size", "2", "--zero-stage", "3"], []),
    "dp4_ep4_zero1": (4, ["--expert-model-parallel-size", "4", "--zero-stage", "1"], []),
    "ep2_host": (2, ["--expert-model-parallel-size", "2", "--zero-stage", "2",
                     "--offload-optimizer", "cpu"], []),
    "ep2_nvme": (2, ["--expert-model-parallel-size", "2", "--zero-stage", "3",
                     "--offload-optimizer", "nvme", "--offload-param", "nvme",
                     "--offload-nvme-path", "{nvme}", "--offload-buffer-size", "65536"], []),
    "pp2_ep2_1f1b": (4, PP2 + ["--expert-model-parallel-size", "2", "--zero-stage", "1"], []),
    "pp2_ep2_zb_h1": (4, PP2 + ["--expert-model-parallel-size", "2", "--pipeline-schedule",
                                "zb_h1"], []),
    "ep2_recompute": (2, ["--expert-model-parallel-size", "2", "--recompute-granularity",
                          "full", "--recompute-method", "uniform", "--recompute-num-layers",
                          "2"], []),
    "ep2_capacity": (2, ["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor",
                         "0.75"], ["--moe-expert-capacity-factor", "0.75"]),
    # device-limited routing: each token's 2 experts on one EP rank (2 groups of 2)
    "ep2_groups": (2, ["--expert-model-parallel-size", "2", "--moe-router-num-groups", "2",
                       "--moe-router-group-topk", "1"],
                   ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]),
    "sigmoid_bias": (2, ["--moe-router-score-function", "sigmoid",
                         "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
                         "0.01"],
                     ["--moe-router-score-function", "sigmoid",
                      "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
                      "0.01"]),
    # the attention's TP (with SP) and CP: each rank routes its own tokens, the losses,
    # counts and drops are the whole micro-batch's; the EP group folds over TP and CP
    "tp2": (2, TP2 + ["--zero-stage", "1"], []),
    "tp2_ep2": (2, TP2 + ["--expert-model-parallel-size", "2", "--zero-stage", "1"], []),
    "tp2_dp2_ep4_zero3": (4, TP2 + ["--expert-model-parallel-size", "4", "--zero-stage",
                                    "3"], []),
    "tp2_ep2_capacity": (2, TP2 + ["--expert-model-parallel-size", "2", "--zero-stage", "0",
                                   "--moe-expert-capacity-factor", "0.75"],
                         ["--moe-expert-capacity-factor", "0.75"]),
    "cp2": (2, CP2 + ["--zero-stage", "2"], []),
    "cp2_ep2": (2, CP2 + ["--expert-model-parallel-size", "2", "--zero-stage", "3"], []),
    "cp2_seq_aux_loss": (2, CP2 + ["--moe-router-load-balancing-type", "seq_aux_loss"],
                         ["--moe-router-load-balancing-type", "seq_aux_loss"]),
    "tp2_cp2_ep4": (4, TP2 + CP2 + ["--expert-model-parallel-size", "4", "--zero-stage",
                                    "1", "--moe-expert-capacity-factor", "0.75"],
                    ["--moe-expert-capacity-factor", "0.75"]),
    "pp2_tp2_ep2": (4, PP2 + TP2 + ["--expert-model-parallel-size", "2", "--zero-stage",
                                    "1"], []),
    # expert tensor parallelism: each expert's hidden units over ETP ranks (innermost in
    # the expert layout), alone, under the attention's TP, with EP, unsharded and at ZeRO 3
    "etp2": (2, ["--expert-tensor-parallel-size", "2", "--zero-stage", "1"], []),
    "etp2_ep2_zero0": (4, ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size",
                           "2", "--zero-stage", "0"], []),
    "tp2_etp2_ep2_zero3": (4, TP2 + ["--expert-tensor-parallel-size", "2",
                                     "--expert-model-parallel-size", "2", "--zero-stage", "3"],
                           []),
    "tp2_etp2_ep4": (8, TP2 + ["--expert-tensor-parallel-size", "2",
                               "--expert-model-parallel-size", "4", "--zero-stage", "1"], []),
    "pp2_etp2_zb_h1": (4, PP2 + ["--expert-tensor-parallel-size", "2", "--pipeline-schedule",
                                 "zb_h1", "--zero-stage", "2"], []),
    "tp2_etp2_capacity": (2, TP2 + ["--expert-tensor-parallel-size", "2", "--zero-stage", "2",
                                    "--moe-expert-capacity-factor", "0.75"],
                          ["--moe-expert-capacity-factor", "0.75"]),
    # global_aux_loss (the step's running counts over DP: the same as one process where
    # the micro-batches run as there, DP 1), under TP x EP, a pipeline, CP with recompute
    "global_tp2_ep2": (2, TP2 + GLOBAL + ["--expert-model-parallel-size", "2"], GLOBAL),
    "global_pp2_1f1b": (2, PP2 + GLOBAL + ["--pipeline-schedule", "1f1b"], GLOBAL),
    "global_cp2_recompute": (2, CP2 + GLOBAL + ["--recompute-granularity", "full",
                                                "--recompute-method", "uniform",
                                                "--recompute-num-layers", "2"], GLOBAL),
}
# the suite's cells (tests/models/test_moe_grid.py): sharded states, a pipeline's split
# backward, recompute, drops, the bias update; experts over EP folded over TP with drops
# at ZeRO 0, at ZeRO 3 with an expert DP group of 2, under a pipeline, and over TP x CP
DIAGONAL = ("dp2_zero3", "pp2_zb_h1", "recompute_full", "capacity", "sigmoid_bias",
            "tp2_ep2_capacity", "dp4_ep2_zero3", "pp2_ep2_zb_h1", "tp2_cp2_ep4")


def _train(n: int, flags: list[str], workdir: str, name: str, common: tuple[str, ...] = ()):
    """(training records, validation records) of one run, or raises naming it."""
    path = f"{workdir}/{name}.jsonl"
    flags = [f.replace("{nvme}", f"{workdir}/{name}.nvme") for f in flags]
    r = pretrain(n, [*TINY, *MOE, *common, "--log-json", path, *flags])
    if r.returncode != 0:
        raise AssertionError(f"{name} (exit {r.returncode}):\n{r.stdout[-2000:]}\n"
                             f"{r.stderr[-3000:]}")
    return read_json_log(path), read_json_log(path, "valid")


def differences(ran, ref) -> dict:
    """The largest relative differences of ``ran``'s losses, grad norms, validation loss
    and MoE aux and z losses from ``ref``'s, and the count of MoE integers that differ
    (tokens per expert, dropped); raises if the records differ in number or layers."""
    (log, valid), (ref_log, ref_valid) = ran, ref
    if len(log) != len(ref_log) or len(valid) != len(ref_valid) or not log or not valid:
        raise AssertionError(f"{len(log)} steps, {len(valid)} evaluations; the reference "
                             f"{len(ref_log)}, {len(ref_valid)}")
    rel = {key: max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(log, ref_log))
           for key in ("loss", "grad_norm")}
    rel["valid_loss"] = abs(valid[0]["loss"] - ref_valid[0]["loss"]) / abs(ref_valid[0]["loss"])
    rel["moe_losses"], counts = 0.0, 0
    for a, b in zip(log, ref_log):
        if a["moe"].keys() != b["moe"].keys() or not b["moe"]:
            raise AssertionError(f"MoE layers {sorted(a['moe'])}; the reference's "
                                 f"{sorted(b['moe'])}")
        for layer, want in b["moe"].items():
            got = a["moe"][layer]
            for key in ("aux_loss", "z_loss"):
                rel["moe_losses"] = max(rel["moe_losses"],
                                        abs(got[key] - want[key]) / max(abs(want[key]), 1e-12))
            counts += sum(got[k] != want[k] for k in ("tokens_per_expert_min",
                                                      "tokens_per_expert_max",
                                                      "dropped_per_step"))
    rel["moe_counts_differing"] = counts
    return rel


def run(names: list[str], workdir: str, out=sys.stdout, common: tuple[str, ...] = (),
        extra: Mapping[str, Sequence[str]] | None = None) -> list[dict]:
    """Run the cells ``names`` (each reference once), one JSON line per cell on ``out``;
    ``common``: flags after :data:`MOE` in every run, the references' too; ``extra``:
    a cell's own further flags, its reference's too (a reference of its own)."""
    refs: dict[tuple[str, ...], tuple] = {}
    results = []
    for name in names:
        n, flags, ref_flags = CELLS[name]
        more = list((extra or {}).get(name, ()))
        key = tuple(ref_flags + more)
        if key not in refs:
            refs[key] = _train(1, ref_flags + more, workdir, f"ref_{len(refs)}", common)
        t = time.perf_counter()
        rel = differences(_train(n, flags + more, workdir, name, common), refs[key])
        ok = (max(v for k, v in rel.items() if k != "moe_counts_differing") <= TOLERANCE
              and rel["moe_counts_differing"] == 0)
        line = {"cell": name, "world": n, **{k: float(f"{v:.3g}") for k, v in rel.items()},
                "ok": ok, "seconds": round(time.perf_counter() - t, 2)}
        results.append(line)
        print(json.dumps(line), file=out, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None,
                        help=f"cells to run ({', '.join(CELLS)}); all by default")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        results = run(args.only or list(CELLS), workdir)
    failed = [r for r in results if not r["ok"]]
    print(json.dumps({"cells": len(results), "failed": len(failed)}))
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
