"""The measures of a training run from its console lines, time-stamped as they arrived
(``launch.run_timed``): the same measures for nanoGPT's train.py and hybrid's
pretrain_gpt.py, each with its own patterns for iteration and evaluation lines."""

from __future__ import annotations

import re

from benchmarks.timing import median, rnd

NANO_ITER = re.compile(r"^iter (\d+): loss ([-+0-9.eE]+|nan), time ([0-9.]+)ms")
NANO_EVAL = re.compile(r"^step (\d+): train loss ([-+0-9.eE]+|nan), val loss ([-+0-9.eE]+|nan)")
NANO_SETUP_END = "using fused AdamW"
HYB_ITER = re.compile(r"^\s*iteration\s+(\d+)/\s*(\d+)\s*\|")
HYB_EVAL = re.compile(r"^\s*valid loss at iteration\s+(\d+)\s*\|\s*lm loss:\s*([-+0-9.eE]+|nan)")


def parse_lines(lines, iter_re, eval_re, eval_loss_group: int):
    """[(t, kind, match)] with kind iter / eval / other, from time-stamped lines."""
    out = []
    for t, line in lines:
        m = iter_re.match(line)
        if m:
            out.append((t, "iter", m))
            continue
        m = eval_re.match(line)
        if m:
            out.append((t, "eval", m))
            continue
        if line.strip() and not set(line.strip()) <= {"-"}:  # hybrid's eval rulers: not lines
            out.append((t, "other", line))
    return out


def measures(entries, wall: float, warmup: int, eval_loss_group: int, setup_end=None) -> dict:
    """The same measures for both sides, from their time-stamped console lines."""
    first = next((i for i, e in enumerate(entries) if e[1] in ("iter", "eval")), None)
    if first is None:
        return {"wall_s": rnd(wall, 3)}
    startup_at = entries[first - 1][0] if first > 0 else entries[first][0]
    if setup_end is not None:  # nanoGPT: the optimizer's line is the last one of its setup
        for t, kind, m in entries[:first]:
            if kind == "other" and setup_end in m:
                startup_at = t
    gaps = [entries[i][0] - entries[i - 1][0] for i in range(1, len(entries))
            if entries[i][1] == "iter" and entries[i - 1][1] == "iter"]
    gaps = gaps[warmup:]
    evals = [entries[i][0] - entries[i - 1][0] for i in range(max(first, 1), len(entries))
             if entries[i][1] == "eval"]
    if first == 0 and entries[0][1] == "eval":
        evals.insert(0, None)
    final = [e for e in entries if e[1] == "eval"]
    iters = [e for e in entries if e[1] == "iter"]
    ev_total = sum(x for x in evals if x is not None)
    return {"wall_s": rnd(wall, 3), "startup_s": rnd(startup_at, 3),
            "per_iteration_s": rnd(median(gaps), 6), "iterations_timed": len(gaps),
            "eval_s": rnd(ev_total, 3), "evals": len(evals),
            "per_eval_s": rnd(median(evals), 4),
            "wall_minus_eval_s": rnd(wall - ev_total, 3),
            "iterations": int(iters[-1][2].group(1)) if iters else 0,
            "final_val_loss": (float(final[-1][2].group(eval_loss_group)) if final else None),
            "final_val_iteration": int(final[-1][2].group(1)) if final else None}
