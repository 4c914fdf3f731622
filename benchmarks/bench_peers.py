#!/usr/bin/env python
"""hybrid side by side with the peers a user would pick instead: megatron-core at TP 2, nanoGPT.

    python -m benchmarks.bench_peers --nanogpt-dir /tmp/nanogpt        # all three sections
    python -m benchmarks.bench_peers --sections megatron_separate megatron_inprocess
    python -m benchmarks.bench_peers --sections nanogpt --nanogpt-dir DIR --nanogpt-iters 500
    python -m benchmarks.bench_peers --pairs 2 --steps 8 --json-out runs/peers.json

One JSON line per section on stdout (and all of them in one object with
``--json-out``). Every ratio is hybrid / peer, so below 1 means hybrid is
faster; each side's raw medians stand beside it. Runs alternate ABBA (hybrid,
peer, peer, hybrid, ...), warm-up steps are left out, and a ratio is the
median of the pairs' ratios. docs/peers.md says how to set the peers up.

Sections:

``megatron_separate`` -- hybrid TP 2 and megatron-core 0.16.1 TP 2 as separate
commands: ``--pairs`` x 2 launches of ``torchrun --nproc-per-node 2`` (gloo,
OMP_NUM_THREADS=1), each running this script's worker for one system. GPT-2,
4 layers, hidden 256, 4 heads, seq 128, vocab 8192, micro-batch 4 per rank,
fp32, dropout 0, AdamW (lr 1e-4, weight decay 0.01 off biases and norms), grad
clipping at 1.0, the same synthetic tokens on both. Per launch: startup (launch
to the first iteration: interpreter, imports, process groups, model build),
the median step (forward + backward + optimizer step, perf_counter, the slower
rank's time per step) over ``--steps`` after ``--warmup``, and an evaluation
(forward only over ``--eval-iters`` batches, median of ``--eval-repeats``).
hybrid's model and engine are built as training builds them
(``hybrid.train.setup.build_engine``, ZeRO stage ``--zero-stage``); megatron-core's
``GPTModel`` with ``get_gpt_layer_local_spec()`` and ``torch.optim.AdamW``
(what megatron-core's optimizer falls back to without Apex / Transformer
Engine; its quick-start loop steps a torch optimizer too), with megatron's
TP-aware grad-norm clipping written out in torch (its own assumes CUDA). The
CPU patches are those of ../shared/BENCHMARKS.md: ``torch.cuda.current_device``
answers "cpu", the CUDA RNG tracker's ``fork`` is a no-op (exact at dropout 0),
a causal mask built on the CPU with explicit position ids, and the fusions off.

``megatron_inprocess`` -- the same two models in the same 2 ranks of one
launch (hybrid's groups from ``init_distributed``, megatron-core's from
``initialize_model_parallel``, one gloo world), stepped alternately ABBA, each
step timed; setup time of each model, medians of steps and evaluations.

``nanogpt`` -- hybrid in one process (``scripts/pretrain_gpt.py``, no torchrun)
against nanoGPT's ``train.py`` with its CPU recipe (``config/train_shakespeare_char.py
--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64
--batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0``, ``--nanogpt-iters``
iterations), on the same text (nanoGPT's ``data/shakespeare_char/input.txt``,
90/10 train/valid for both; hybrid with its byte tokenizer, which is nanoGPT's
character vocabulary on this ASCII text) with the same schedule (lr 1e-3 to
1e-4 cosine after 100 warm-up iterations, beta2 0.99, weight decay 0.1, clip
1.0, no linear biases) and evaluation (every 250 iterations, 20 batches of 12).
Both are run as a user runs them; from their console lines, time-stamped as
they arrive, each side gets the same measures: wall time (launch to exit),
startup (launch to the last line before the training loop), per-iteration
(median gap between consecutive iteration lines with nothing in between),
evaluation (from the line before an evaluation's line to it) and the final
validation loss. nanoGPT also estimates the train loss at each evaluation (20
more batches) and evaluates at iteration 0; hybrid reports the train loss of
its steps instead: ``wall_minus_eval_s`` shows the time without evaluations.

The summary line gives the ratios the claims are about: ``inprocess_step``,
``separate_step``, ``nanogpt_wall`` (and ``nanogpt_val_loss_delta``, hybrid minus
nanoGPT, negative = better).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from benchmarks.peers import megatron_sections, nanogpt
from benchmarks.peers.worker import worker
from benchmarks.timing import Stopwatch, emit, now

SECTIONS = ["megatron_separate", "megatron_inprocess", "nanogpt"]
SECTION_FNS = {"megatron_separate": megatron_sections.section_megatron_separate,
               "megatron_inprocess": megatron_sections.section_megatron_inprocess,
               "nanogpt": nanogpt.section_nanogpt}


def _summary(results: dict) -> dict:
    """The three ratios the claims are about (None where a section did not run)."""
    def get(sec, *keys):
        v = results.get(sec)
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v
    return {"inprocess_step": get("megatron_inprocess", "step", "ratio"),
            "separate_step": get("megatron_separate", "step", "ratio"),
            "nanogpt_wall": get("nanogpt", "wall", "ratio"),
            "nanogpt_val_loss_delta": get("nanogpt", "final_val_loss", "delta")}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS)
    # 8 pairs of 40 steps: with 4 of 10 the separate pairs spread 0.78-1.27 on the
    # 2-core machine and the median moved by 0.25 from run to run (docs/peers.md)
    ap.add_argument("--pairs", type=int, default=8,
                    help="megatron_separate: ABBA pairs of launches")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per system per launch")
    ap.add_argument("--warmup", type=int, default=2,
                    help="steps (nanogpt: iteration gaps) left out before timing")
    ap.add_argument("--eval-iters", type=int, default=10,
                    help="TP sections: batches per evaluation")
    ap.add_argument("--eval-repeats", type=int, default=3, help="TP sections: evaluations timed")
    ap.add_argument("--zero-stage", type=int, choices=(0, 1), default=0,
                    help="hybrid's ZeRO stage in the TP sections (DP is 1 there)")
    ap.add_argument("--tp", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--nanogpt-dir", default=os.environ.get("NANOGPT_DIR"),
                    help="nanoGPT's source directory (git archive of karpathy/nanoGPT); "
                         "default $NANOGPT_DIR; without it the nanogpt section is skipped")
    ap.add_argument("--corpus", default=None,
                    help="tinyshakespeare.txt, copied to nanoGPT's data/shakespeare_char/"
                         "input.txt when that is missing (its prepare.py would download it)")
    ap.add_argument("--nanogpt-iters", type=int, default=2000,
                    help="iterations of both runs (the recipe's 2000)")
    ap.add_argument("--nanogpt-pairs", type=int, default=1,
                    help="ABBA pairs of nanogpt / hybrid runs")
    ap.add_argument("--hybrid-args", nargs=argparse.REMAINDER, default=[],
                    help="extra pretrain_gpt.py flags for the nanogpt section (last)")
    ap.add_argument("--blocked", action="store_true",
                    help="TP sections: also time each step's wait in collectives, by phase "
                         "(benchmarks/peers/blocked.py)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    ap.add_argument("--json-out", default=None, help="also write every section here")
    ap.add_argument("--verbose", action="store_true", help="keep every launch's record")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--worker", choices=("hybrid", "megatron", "inprocess"),
                    help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.worker:
        return worker(a)
    os.environ["OMP_NUM_THREADS"] = "1"
    import signal  # SIGTERM ends the launch in progress too (run_timed), not only this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {}
    t0 = now()
    for name in a.sections:
        with Stopwatch() as sw:
            res = SECTION_FNS[name](a)
        res = {"section": name, **{k: v for k, v in res.items() if v is not None},
               "section_wall_s": round(sw.seconds, 1)}
        results[name] = res
        emit(res)
    import torch
    summary = {"section": "summary", "ratios_hybrid_over_peer": _summary(results),
               "total_wall_s": round(now() - t0, 1),
               "machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "cpus": os.cpu_count(), "omp_num_threads": 1,
                           "date": time.strftime("%Y-%m-%d")}}
    emit(summary)
    if a.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(a.json_out)), exist_ok=True)
        with open(a.json_out, "w", encoding="utf-8") as f:
            json.dump({"sections": results, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
