#!/usr/bin/env python
"""A transformers Trainer script on hybrid's ZeRO-3 against the Trainer's own run (JSON).

    python -m benchmarks.bench_hf_trainer                  # BERT 4 x 256, 2 ranks, 16 steps
    python -m benchmarks.bench_hf_trainer --hidden 512 --layers 6 --steps 32

Two runs of one script, each its own ``torchrun`` job of fresh processes (so each
rank's peak is that run's): the Trainer without DeepSpeed (DDP; ``use_cpu`` on a
machine without CUDA), and the same script with its import changed to
``from hybrid.deepspeed.hf import Trainer, TrainingArguments`` and
``TrainingArguments(deepspeed=ds_config)``: ZeRO-3, ``offload_optimizer: cpu``, every
value the Trainer knows written ``"auto"``. In the hybrid job the installed DeepSpeed
is hidden from the import system: the route needs none. Both train a
BertForSequenceClassification (random init, a hand-built config) on synthetic labels
from the same initialization and batches, then evaluate. Per run one JSON line: the
logged losses, the eval loss, each rank's peak memory (resident set on the CPU,
``max_memory_allocated`` on a GPU) and model-state bytes (the engine's count; DDP's
are parameters, gradients and AdamW's two moments, 16 bytes a parameter), and the
median seconds per optimizer step. A last line gives the largest loss difference.
Nothing is asserted: docs/measurements.md keeps figures with their machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.timing import emit, median


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq-length", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps (one epoch)")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--worker", choices=("plain", "hybrid"), default=None,
                    help="(one rank of one run, under torchrun)")
    ap.add_argument("--out", default=None, help="(the worker's result directory)")
    return ap.parse_args(argv)


def _hide_deepspeed() -> None:
    """The import system finds no ``deepspeed`` package from here on (as on a machine
    without it); accelerate and transformers then take their paths without DeepSpeed."""
    import importlib.machinery

    finder = importlib.machinery.PathFinder
    find = finder.find_spec.__func__  # type: ignore[attr-defined]

    def find_spec(cls, name, path=None, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            return None
        return find(cls, name, path, target)
    finder.find_spec = classmethod(find_spec)  # type: ignore[method-assign,assignment]


def _ds_config(lr: float) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                      "eps": "auto", "weight_decay": "auto"}},
            # constant at the peak, as the plain run's lr_scheduler_type="constant"
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": lr,
                                                         "warmup_max_lr": "auto",
                                                         "warmup_num_steps": "auto"}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "stage3_param_persistence_threshold": "auto"}}


def _worker(a: argparse.Namespace) -> None:
    """One rank of one run."""
    if a.worker == "hybrid":
        _hide_deepspeed()
    import resource

    import torch
    import transformers

    if a.worker == "hybrid":
        from hybrid.deepspeed.hf import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments  # type: ignore[assignment]

    class Labelled(torch.utils.data.Dataset):
        def __init__(self, n: int, seed: int):
            g = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(1, a.vocab, (n, a.seq_length), generator=g)
            self.labels = (self.ids[:, 0] < a.vocab // 2).long()

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.labels[i],
                    "attention_mask": torch.ones(a.seq_length, dtype=torch.long)}

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    cuda = torch.cuda.is_available()
    settings: dict[str, Any] = dict(
        output_dir=os.path.join(a.out, "trainer"), per_device_train_batch_size=a.micro_batch_size,
        gradient_accumulation_steps=a.accumulation, num_train_epochs=1, learning_rate=a.lr,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        disable_tqdm=True, per_device_eval_batch_size=a.micro_batch_size, seed=7)
    if a.worker == "hybrid":
        settings["deepspeed"] = _ds_config(a.lr)
    elif not cuda:
        settings["use_cpu"] = True
    args = TrainingArguments(**settings)
    config = transformers.BertConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, intermediate_size=4 * a.hidden,
        max_position_embeddings=a.seq_length, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    config.num_labels = 2
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    numel = sum(p.numel() for p in model.parameters())
    samples = a.steps * a.ranks * a.micro_batch_size * a.accumulation
    clock = StepClock()
    trainer = Trainer(model=model, args=args, train_dataset=Labelled(samples, 1),
                      eval_dataset=Labelled(8 * a.ranks * a.micro_batch_size, 2),
                      callbacks=[clock])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    evaluated = trainer.evaluate()
    engine = getattr(trainer, "engine", None)
    states = engine.zero.model_state_bytes()["total"] if engine is not None else 16 * numel
    ends = [start] + clock.ends
    rank = int(os.environ.get("RANK", "0"))
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    record = {"losses": [h["loss"] for h in trainer.state.log_history
                         if "loss" in h and "train_loss" not in h],
              "eval_loss": evaluated["eval_loss"], "peak_mib": round(peak / 2 ** 20, 1),
              "model_state_mib": round(states / 2 ** 20, 2), "numel": numel,
              "step_s": median([t1 - t0 for t0, t1 in zip(ends, ends[1:])]),
              "deepspeed_imported": "deepspeed" in sys.modules}
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def _run(a: argparse.Namespace, route: str, argv: list[str]) -> list[dict]:
    """One torchrun job of ``a.ranks`` workers; their records by rank."""
    out = tempfile.mkdtemp(prefix=f"bench_hf_trainer_{route}_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(a.ranks), "-m", "benchmarks.bench_hf_trainer", *argv,
           "--worker", route, "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    r = subprocess.run(cmd, capture_output=True, check=False, text=True, env=env, cwd=root)
    if r.returncode:
        sys.exit(f"bench_hf_trainer: the {route} run failed:\n{r.stderr[-4000:]}")
    records = []
    for rank in range(a.ranks):
        with open(os.path.join(out, f"rank{rank}.json"), encoding="utf-8") as f:
            records.append(json.load(f))
    return records


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _args(argv)
    if a.worker is not None:
        _worker(a)
        return
    runs = {}
    for route in ("plain", "hybrid"):
        ranks = _run(a, route, argv)
        runs[route] = ranks[0]["losses"]
        emit({"run": route, "ranks": a.ranks, "numel": ranks[0]["numel"],
              "losses": [round(x, 6) for x in ranks[0]["losses"]],
              "eval_loss": round(ranks[0]["eval_loss"], 6),
              "peak_mib_per_rank": [r["peak_mib"] for r in ranks],
              "model_state_mib_per_rank": [r["model_state_mib"] for r in ranks],
              "step_s": round(ranks[0]["step_s"] or 0.0, 4),
              "deepspeed_imported": any(r["deepspeed_imported"] for r in ranks)})
    worst = max(abs(x - y) / abs(y) for x, y in zip(runs["hybrid"], runs["plain"]))
    emit({"max_relative_loss_difference": worst})


if __name__ == "__main__":
    main()
