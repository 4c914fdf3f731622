#!/usr/bin/env python
"""How long a save blocks the training loop: synchronous against ``--async-save``.

    python -m benchmarks.bench_async_save [--layers 24 --hidden-size 1024 --heads 16]
        [--world 1] [--zero-stage 1] [--nvme DIR] [--repeat 2]

One session of ``--world`` local processes (gloo, CPU) builds a GPT (the default: the
302M-parameter model of docs/measurements.md) under ZeRO, takes one optimizer step (so
the moments are not zero) and saves it, alternating a synchronous save with an
asynchronous one (``--repeat`` times each, into fresh directories, each directory
removed after). Reported per rank 0, in seconds between barriers:

* ``sync_blocked_s``: the whole :func:`hybrid.checkpoint.save_checkpoint`;
* ``async_blocked_s``: what the loop waits for with ``--async-save``: the collective
  first phase with the snapshot of this rank's values into host memory
  (:func:`hybrid.checkpoint.save.prepare_save` into the saver's buffer, allocated at the
  first async save and reused: ``runs`` shows the first one apart) and the thread's
  start (:class:`hybrid.checkpoint.async_save.AsyncSaver`);
* ``async_total_s``: until that checkpoint is published (:meth:`AsyncSaver.wait`);
* ``blocked_ratio``: the medians' ratio, async over sync (the issue's bar: at most 0.05).

``--nvme DIR``: ZeRO 3 with the optimizer and the parameters on NVMe under ``DIR``.
Prints one JSON object; asserts nothing about time (benchmarks/timing.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

import torch

from benchmarks.timing import Stopwatch, emit, median_of, world_barrier
from hybrid.testing.pool import run_ranks

VOCAB = 50257


def _session(ps, root: str, model_args: dict[str, Any], stage: int, nvme: str | None,
             repeat: int) -> dict:
    from hybrid.checkpoint import save_checkpoint
    from hybrid.checkpoint.async_save import AsyncSaver
    from hybrid.checkpoint.save import prepare_save
    from hybrid.checkpoint.snapshot import snapshot_for
    from hybrid.config import Flags, build_config
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    offload: dict[str, Any] = ({"offload_optimizer": "nvme", "offload_param": "nvme",
                                "offload_nvme_path": nvme} if nvme else {})
    cfg = build_config(Flags(zero_stage=stage, seed=3, hidden_dropout=0.0,
                             attention_dropout=0.0, **offload, **model_args), ps.world_size)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    model, _, engine = build_engine(cfg, ps, VOCAB, rng)
    tokens = torch.randint(0, VOCAB, (1, model_args["seq_length"] + 1),
                           generator=torch.Generator().manual_seed(ps.dp_rank))
    engine.zero_grad()
    engine.backward(model(tokens[:, :-1], tokens[:, 1:]))
    engine.step(1e-4)
    barrier = world_barrier(ps)
    saver = AsyncSaver(ps, snapshot_for(engine))  # as the trainer makes it, its memory
    saver.buffer.reserve(3 * sum(pc.hi - pc.lo for pc in engine.owned_pieces()))  # touched
    times: dict[str, list[float]] = {"sync": [], "async": [], "async_total": []}
    for i in range(repeat):
        save = os.path.join(root, f"sync{i}")
        with Stopwatch(barrier=barrier) as sw:
            save_checkpoint(save, 1, 1, engine, ps, cfg.to_dict(), rng, vocab_size=VOCAB)
        times["sync"].append(sw.seconds)
        barrier()
        if ps.rank == 0:
            shutil.rmtree(save)
        save = os.path.join(root, f"async{i}")
        with Stopwatch(barrier=barrier) as sw:
            saver.start(prepare_save(save, 1, 1, engine, ps, cfg.to_dict(), rng,
                                     vocab_size=VOCAB, snapshot=saver.buffer))
        times["async"].append(sw.seconds)
        with Stopwatch(barrier=barrier) as total:
            saver.wait()
        times["async_total"].append(sw.seconds + total.seconds)
        barrier()
        if ps.rank == 0:
            shutil.rmtree(save)
    engine.close()
    return {"parameters": sum(p.numel() for p in model.parameters()), **times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--nvme", default=None, help="ZeRO 3, optimizer and parameters on NVMe here")
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args(argv)
    model_args = {"num_layers": a.layers, "hidden_size": a.hidden_size,
                  "num_attention_heads": a.heads, "seq_length": a.seq_length,
                  "micro_batch_size": 1}
    stage = 3 if a.nvme else a.zero_stage
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        out = run_ranks(_session, a.world, args=(root, model_args, stage, a.nvme, a.repeat),
                        timeout=3600, reuse=False)[0]
    sync_s, async_s = median_of(out["sync"]), median_of(out["async"])
    emit({"bench": "async_save", "parameters_per_rank": out["parameters"],
          "world": a.world, "zero_stage": stage, "nvme": bool(a.nvme),
          "repeat": a.repeat, "sync_blocked_s": round(sync_s, 3),
          "async_blocked_s": round(async_s, 3),
          "async_total_s": round(median_of(out["async_total"]), 3),
          "blocked_ratio": round(async_s / sync_s, 4),
          "runs": {k: [round(x, 3) for x in v] for k, v in out.items() if k != "parameters"}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
