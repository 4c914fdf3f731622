"""The ``nanogpt`` section: nanoGPT's train.py with its CPU recipe against hybrid's
pretrain_gpt.py in one process, the same shape, schedule and text, ABBA pairs of runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from benchmarks.peers.common import ROOT, SCRIPTS, progress
from benchmarks.peers.console import (
    HYB_EVAL,
    HYB_ITER,
    NANO_EVAL,
    NANO_ITER,
    NANO_SETUP_END,
    measures,
    parse_lines,
)
from benchmarks.peers.launch import child_env, git_head, run_timed, tail
from benchmarks.timing import abba, median, pair_record, rnd

# nanoGPT's CPU recipe (README; ../shared/BENCHMARKS.md), on top of config/train_shakespeare_char.py
NANOGPT_RECIPE = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
                  "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                  "--n_embd=128", "--dropout=0.0"]


def nanogpt_data(a) -> str | None:
    """Make sure nanoGPT's shakespeare_char data exists (its own prepare.py, fed
    ``--corpus`` when input.txt is missing, so nothing is downloaded); return why not."""
    d = os.path.join(a.nanogpt_dir, "data", "shakespeare_char")
    needed = [os.path.join(d, f) for f in ("train.bin", "val.bin", "meta.pkl", "input.txt")]
    if all(os.path.isfile(f) for f in needed):
        return None
    inp = os.path.join(d, "input.txt")
    if not os.path.isfile(inp):
        if not a.corpus or not os.path.isfile(a.corpus):
            return (f"{inp} is missing and no --corpus (tinyshakespeare.txt) was given: "
                    f"nanoGPT's prepare.py would download it")
        shutil.copyfile(a.corpus, inp)
    r = subprocess.run([sys.executable, os.path.join(d, "prepare.py")], check=False,
                       cwd=a.nanogpt_dir,
                       capture_output=True, text=True, env=child_env())
    if r.returncode != 0:
        return f"nanoGPT's data/shakespeare_char/prepare.py failed: {r.stderr.strip()[-400:]}"
    return None


def nanogpt_run(a, iters: int, warmup_iters: int, eval_interval: int, out_dir: str) -> dict:
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", *NANOGPT_RECIPE,
           f"--max_iters={iters}", f"--lr_decay_iters={iters}",
           f"--warmup_iters={warmup_iters}", f"--eval_interval={eval_interval}",
           f"--out_dir={out_dir}"]
    rc, wall, lines = run_timed(cmd, cwd=a.nanogpt_dir, timeout=a.timeout)
    if rc != 0:
        raise RuntimeError(f"nanoGPT train.py failed (exit {rc}):\n{tail(lines)}")
    entries = parse_lines(lines, NANO_ITER, NANO_EVAL, 3)
    res = measures(entries, wall, a.warmup, 3, setup_end=NANO_SETUP_END)
    ms = [float(m.group(3)) / 1000 for _, k, m in entries if k == "iter"]
    res["self_reported_iteration_s"] = rnd(median(ms[a.warmup:]), 6)  # its own dt (incl. evals)
    return res


def hybrid_run(a, iters: int, warmup_iters: int, eval_interval: int, corpus: str,
               work: str) -> dict:
    log_json = os.path.join(work, "hybrid_log.jsonl")
    cmd = [sys.executable, os.path.join(SCRIPTS, "pretrain_gpt.py"),
           "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
           "--seq-length", "64", "--micro-batch-size", "12", "--global-batch-size", "12",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
           "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
           "--lr-warmup-iters", str(warmup_iters), "--lr-decay-iters", str(iters),
           "--train-iters", str(iters), "--adam-beta1", "0.9", "--adam-beta2", "0.99",
           "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1337",
           "--data-path", corpus, "--split", "9,1,0", "--tokenizer-type", "byte",
           "--data-cache-path", os.path.join(work, "cache"),
           "--eval-interval", str(eval_interval), "--eval-iters", "20",
           "--log-interval", "1", "--log-json", log_json, *a.hybrid_args]
    rc, wall, lines = run_timed(cmd, cwd=ROOT, timeout=a.timeout)
    if rc != 0:
        raise RuntimeError(f"hybrid pretrain_gpt.py failed (exit {rc}):\n{tail(lines)}")
    entries = parse_lines(lines, HYB_ITER, HYB_EVAL, 2)
    res = measures(entries, wall, a.warmup, 2)
    with open(log_json, encoding="utf-8") as f:
        recs = [json.loads(x) for x in f if x.strip()]
    steps = [r["step_time_s"] for r in recs if "step_time_s" in r]
    res["self_reported_iteration_s"] = rnd(median(steps[a.warmup:]), 6)  # its step_time_s
    return res


def _skip_reason(a) -> str | None:
    """Why the section cannot run (no nanoGPT source, or no data for it), or None."""
    if not a.nanogpt_dir:
        return ("no --nanogpt-dir: nanoGPT is not a pip package; give the "
                "directory of its source (docs/peers.md)")
    if not os.path.isfile(os.path.join(a.nanogpt_dir, "train.py")):
        return f"--nanogpt-dir {a.nanogpt_dir}: no train.py there"
    return nanogpt_data(a)


def section_nanogpt(a) -> dict:
    why = _skip_reason(a)
    if why:
        return {"skipped": why}
    corpus = os.path.join(a.nanogpt_dir, "data", "shakespeare_char", "input.txt")
    iters = a.nanogpt_iters
    warmup_iters = min(100, max(1, iters // 10))
    eval_interval = 250 if iters % 250 == 0 else iters
    runs: dict[str, list[dict]] = {"hybrid": [], "nanogpt": []}
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as work:
        for p in range(a.nanogpt_pairs):  # ABBA
            for kind in abba(p, "hybrid", "nanogpt"):
                d = os.path.join(work, f"{kind}_{p}")
                os.makedirs(d)
                r = (hybrid_run(a, iters, warmup_iters, eval_interval, corpus, d)
                     if kind == "hybrid" else
                     nanogpt_run(a, iters, warmup_iters, eval_interval, d))
                runs[kind].append(r)
                progress(a, f"nanogpt pair {p}: {kind} wall {r['wall_s']}s per-iteration "
                            f"{r['per_iteration_s']}s val {r['final_val_loss']}")
    out = {"recipe": "train.py config/train_shakespeare_char.py " + " ".join(NANOGPT_RECIPE),
           "iterations": iters, "lr_warmup_iters": warmup_iters,
           "eval_interval": eval_interval, "pairs": a.nanogpt_pairs,
           "nanogpt_commit": git_head(a.nanogpt_dir)}
    for key in ("wall_s", "startup_s", "per_iteration_s", "eval_s", "wall_minus_eval_s",
                "self_reported_iteration_s"):
        h = [r.get(key) for r in runs["hybrid"]]
        n = [r.get(key) for r in runs["nanogpt"]]
        out[key[:-2]] = pair_record(h, n, "nanogpt", 6)
    hv = [r["final_val_loss"] for r in runs["hybrid"]]
    nv = [r["final_val_loss"] for r in runs["nanogpt"]]
    mh, mn = median(hv), median(nv)
    out["final_val_loss"] = {"hybrid": hv, "nanogpt": nv, "hybrid_median": rnd(mh, 4),
                             "nanogpt_median": rnd(mn, 4),
                             "delta": (rnd(mh - mn, 4) if mh is not None and mn is not None
                                       and None not in hv + nv else None)}
    out["runs"] = runs
    return out
