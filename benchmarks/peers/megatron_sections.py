"""The TP sections, parent side: ``megatron_separate`` (ABBA pairs of torchrun launches,
one system each) and ``megatron_inprocess`` (one launch, both systems on its ranks). The
ranks run ``python -m benchmarks.bench_peers --worker`` (``benchmarks.peers.worker``)."""

from __future__ import annotations

import json
import sys

from benchmarks.peers.common import (
    CLIP,
    ENTRY,
    LR,
    RESULT_TAG,
    ROOT,
    TP_SHAPE,
    WEIGHT_DECAY,
    progress,
)
from benchmarks.peers.launch import run_timed, tail
from benchmarks.peers.megatron_side import megatron_missing
from benchmarks.timing import abba, median, pair_record, ratio, rnd


def torchrun(a, kind: str):
    """One torchrun launch of ``a.tp`` ranks running worker ``kind``; its record."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(a.tp), *ENTRY, "--worker", kind,
           "--tp", str(a.tp), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--eval-iters", str(a.eval_iters), "--eval-repeats", str(a.eval_repeats),
           "--zero-stage", str(a.zero_stage)] + (["--blocked"] if a.blocked else [])
    rc, wall, lines = run_timed(cmd, cwd=ROOT, timeout=a.timeout)
    res = None
    for _, line in lines:
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
    if rc != 0 or res is None:
        raise RuntimeError(f"{kind} worker failed (exit {rc}):\n{tail(lines)}")
    res["wall_s"] = rnd(wall, 3)
    return res


def shape_record(a) -> dict:
    return {**TP_SHAPE, "tp": a.tp, "precision": "fp32", "dropout": 0.0,
            "optimizer": f"AdamW lr {LR} wd {WEIGHT_DECAY} clip {CLIP}",
            "hybrid_zero_stage": a.zero_stage, "backend": "gloo"}


def section_megatron_separate(a) -> dict:
    why = megatron_missing()
    if why:
        return {"skipped": why}
    import megatron.core
    runs: dict[str, list[dict]] = {"hybrid": [], "megatron": []}
    for p in range(a.pairs):  # ABBA
        for kind in abba(p, "hybrid", "megatron"):
            runs[kind].append(torchrun(a, kind))
            r = runs[kind][-1]
            progress(a, f"megatron_separate pair {p}: {kind} step {r['step_s']}s "
                        f"startup {r['startup_s']}s eval {r['eval_s']}s")
    out = {"megatron_core": megatron.core.__version__, "shape": shape_record(a),
           "pairs": a.pairs, "steps": a.steps, "warmup": a.warmup,
           "eval_iters": a.eval_iters}
    for key in ("startup_s", "step_s", "eval_s", "wall_s"):
        h = [r[key] for r in runs["hybrid"]]
        m = [r[key] for r in runs["megatron"]]
        out[key[:-2]] = {**pair_record(h, m, "megatron"), "hybrid_s": h, "megatron_s": m}
    out["startup"]["parts_median_s"] = {  # where a launch's startup goes, per system
        k: {"torch_import": rnd(median([r["torch_import_s"] for r in v]), 3),
            "imports": rnd(median([r["imports_s"][k] for r in v]), 3),
            "process_groups": rnd(median([r["process_groups_s"] for r in v]), 3),
            "build": rnd(median([r["build_s"] for r in v]), 3)} for k, v in runs.items()}
    out["params_per_rank"] = {k: v[0]["params_per_rank"] for k, v in runs.items()}
    out["losses"] = {k: {"first": [r["first_loss"] for r in v], "last": [r["last_loss"] for r in v],
                         "eval": [r["eval_loss"] for r in v]} for k, v in runs.items()}
    if a.blocked:  # per system: each launch's per-step record, and their median
        out["blocked"] = {k: {"median_ms_per_step": rnd(median(
            [r["blocked"]["blocked_ms_per_step"] for r in v]), 3),
            "launches": [r["blocked"] for r in v]} for k, v in runs.items()}
    out["runs"] = runs if a.verbose else None
    return out


def section_megatron_inprocess(a) -> dict:
    why = megatron_missing()
    if why:
        return {"skipped": why}
    import megatron.core
    res = torchrun(a, "inprocess")
    h, m = res["hybrid"], res["megatron"]
    progress(a, f"megatron_inprocess: hybrid step {h['step_s']}s megatron {m['step_s']}s")
    return {"megatron_core": megatron.core.__version__, "shape": shape_record(a),
            "steps": a.steps, "warmup": a.warmup, "eval_iters": a.eval_iters,
            "startup": {"hybrid_build_s": res["hybrid_build_s"],
                        "megatron_build_s": res["megatron_build_s"],
                        "ratio": rnd(ratio(res["hybrid_build_s"], res["megatron_build_s"]), 4),
                        "imports_s": res["imports_s"],
                        "process_groups_s": res["process_groups_s"]},
            "step": {"hybrid_median_s": h["step_s"], "megatron_median_s": m["step_s"],
                     "ratio": rnd(median(res["pair_ratios"]), 4),
                     "ratio_of_medians": rnd(ratio(h["step_s"], m["step_s"]), 4),
                     "pair_ratios": res["pair_ratios"],
                     "hybrid_s": h["step_times_s"], "megatron_s": m["step_times_s"]},
            "eval": {"hybrid_median_s": h["eval_s"], "megatron_median_s": m["eval_s"],
                     "ratio": rnd(ratio(h["eval_s"], m["eval_s"]), 4),
                     "hybrid_s": h["eval_times_s"], "megatron_s": m["eval_times_s"]},
            "params_per_rank": {k: res[f"{k}_params_per_rank"] for k in ("hybrid", "megatron")},
            "losses": {k: {"first": res[k]["first_loss"], "last": res[k]["last_loss"],
                           "eval": res[k]["eval_loss"]} for k in ("hybrid", "megatron")},
            "blocked": ({k: res[k]["blocked"] for k in ("hybrid", "megatron")}
                        if a.blocked else None),
            "wall_s": res["wall_s"]}
