#!/usr/bin/env python
"""Record the torch DCP fixture of tests/checkpoint/test_peer_dcp.py: a torchtitan-style
Llama trained with FSDP2 on 2 gloo CPU processes, saved with DCP as torchtitan's
CheckpointManager saves, and the 10 losses it goes on with.

    OMP_NUM_THREADS=1 python benchmarks/peers/record_dcp_checkpoint.py [--out DIR]
    OMP_NUM_THREADS=1 python benchmarks/peers/record_dcp_checkpoint.py --tp 2 --world 4 \
        --out tests/fixtures/peers/dcp_fsdp_tp

(DIR: tests/fixtures/peers/dcp by default; it is replaced. ``--tp 2 --world 4`` records
the 2-D fixture: FSDP2 over 2 data-parallel ranks of TP 2 DTensors, torchtitan's
FSDP x TP layout, so each weight is saved in chunks split on both of its dimensions'
owners.) It writes
``DIR/checkpoint.tar.xz``, the folder ``checkpoint/step-3/`` (``.metadata``,
``__0_0.distcp``, ``__1_0.distcp``) as DCP wrote it, packed because DCP's per-entry
pickles (a small file per tensor chunk and per hyperparameter) make it 1.2 MB and
compress to 0.45 MB; and ``DIR/losses.json``: the seed of the batches
(:func:`benchmarks.peers.titan_llama.batch`), the shape, the optimizer, hybrid's flags
for the same run, the 3 losses before the save and the 10 after it. The model is
:mod:`benchmarks.peers.titan_llama`'s (torchtitan's names, arithmetic and checkpoint
structure; torchtitan's own package does not import here, its docstring says why);
FSDP2, AdamW and DCP are torch's own.

``--load CKPT --steps K`` instead loads a DCP checkpoint of that structure (one this
script wrote, or one ``scripts/convert_checkpoint.py export --to dcp`` wrote) into a fresh
FSDP2 model and optimizer, trains K steps from its step on, and prints the losses as
JSON: the way back's check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.peers import titan_llama as tl  # noqa: E402

SEED, SAVE_STEP, AFTER = 1234, 3, 10


def _worker(rank: int, world: int, port: int, job: dict, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out.update(run(job))
    finally:
        dist.destroy_process_group()


def run(job: dict) -> dict:
    """On every rank of an initialized gloo world: the record (``job["out"]``) or the
    continuation of a checkpoint (``job["load"]``); the losses (rank 0's dict)."""
    s = tl.shape()
    tp = job.get("tp", 1)
    dp_rank, dp = dist.get_rank() // tp, dist.get_world_size() // tp
    gb = tl.MICRO * dp
    model = tl.build(s, SEED, tp)
    opt, sched = tl.make_optimizer(model)
    rows = slice(dp_rank * tl.MICRO, (dp_rank + 1) * tl.MICRO)

    def steps(first: int, n: int) -> list[float]:
        losses = []
        for step in range(first, first + n):
            x, y = tl.batch(SEED, step, s, gb)
            losses.append(tl.train_step(model, opt, sched, x[rows], y[rows]))
        return losses

    if job.get("load"):
        start = tl.load(job["load"], model, opt, sched)
        return {"step": start, "losses": steps(start + 1, job["steps"])}
    before = steps(1, SAVE_STEP)
    tl.save(os.path.join(job["out"], "checkpoint"), model, opt, sched, SAVE_STEP, SEED,
            SAVE_STEP * gb * s.seq_len)
    after = steps(SAVE_STEP + 1, AFTER)
    return {"before": before, "after": after}


def launch(job: dict, world: int = 2) -> dict:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(world, port, job, out), nprocs=world, join=True)
        return dict(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "peers", "dcp"))
    ap.add_argument("--load", help="continue this DCP checkpoint instead of recording")
    ap.add_argument("--steps", type=int, default=AFTER)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2-D mesh)")
    ap.add_argument("--world", type=int, default=2, help="gloo processes (TP x FSDP)")
    a = ap.parse_args(argv)
    if a.load:
        print(json.dumps(launch({"load": os.path.abspath(a.load), "steps": a.steps,
                                 "tp": a.tp}, a.world)))
        return 0
    if os.path.isdir(a.out):
        shutil.rmtree(a.out)
    os.makedirs(a.out)
    res = launch({"out": os.path.abspath(a.out), "tp": a.tp}, a.world)
    s = tl.shape()
    fsdp = "fully_shard per block and root, gloo CPU"
    if a.tp > 1:
        fsdp += f"; over the dp dimension of a (dp {a.world // a.tp}, tp {a.tp}) mesh, " \
                "after torchtitan's TP plan (titan_llama.tensor_parallel)"
    record = {"format": "torch DCP, torchtitan CheckpointManager structure",
              "torch": torch.__version__, "seed": SEED, "world_size": a.world,
              "tensor_parallel": a.tp, "data_parallel_size": a.world // a.tp,
              "fsdp": fsdp, "save_step": SAVE_STEP,
              "micro_batch_per_rank": tl.MICRO, "shape": tl.describe(s),
              "optimizer": {"torch.optim.AdamW": {**tl.OPTIM, "foreach": False},
                            "clip_grad_norm": tl.CLIP, "lr_scheduler": "LambdaLR constant"},
              "hybrid_flags": tl.hybrid_flags(s),
              "losses_before_save": res["before"], "losses_after_save": res["after"]}
    with open(os.path.join(a.out, "losses.json"), "w") as f:
        json.dump(record, f, indent=1)
    folder = os.path.join(a.out, "checkpoint")
    with tarfile.open(os.path.join(a.out, "checkpoint.tar.xz"), "w:xz") as tar:
        tar.add(folder, arcname="checkpoint")
    shutil.rmtree(folder)
    print(json.dumps({"after": res["after"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
