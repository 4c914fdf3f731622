"""torch DCP checkpoints as torchtitan writes them (hybrid/checkpoint/peers/dcp.py).

The fixture (tests/fixtures/peers/dcp/, recorded by benchmarks/peers/record_dcp_checkpoint.py):
a torchtitan-style Llama (torchtitan's names, complex-pair RoPE, GQA, SwiGLU) trained 3
steps with FSDP2 on 2 gloo ranks and torch's AdamW, saved with DCP in the structure of
torchtitan's CheckpointManager, and the 10 losses the same run went on with. hybrid
imports it (weights, fp32 masters, both moments, step count, iteration) and trains the
same 10 batches: the losses equal the recorded ones within 2e-6, at the fixture's layout
(2 ranks, ZeRO 3, FSDP's counterpart) and at TP 2. The way back: a hybrid checkpoint
written as DCP, loaded by the FSDP2 model with torch's dcp.load and set_*_state_dict,
goes on with hybrid's losses.
"""

from __future__ import annotations

import json
import os
import tarfile

import pytest

from tests.helpers.harness import run_ranks
from tests.helpers.launch import ROOT

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "peers", "dcp")
TOL = 2e-6


def _record() -> dict:
    with open(os.path.join(FIXTURE, "losses.json")) as f:
        return json.load(f)


def _unpack(tmp_path) -> str:
    """The fixture's DCP checkpoint folder (``checkpoint/step-3``), unpacked from its
    archive (kept compressed: DCP's per-entry pickles compress well)."""
    with tarfile.open(os.path.join(FIXTURE, "checkpoint.tar.xz")) as tar:
        tar.extractall(tmp_path, filter="data")
    return str(tmp_path / "checkpoint")


def _flags(rec: dict, tp: int, world: int, stage: int, **extra) -> dict:
    micro = rec["micro_batch_per_rank"] * rec["world_size"] * tp // world
    return dict(rec["hybrid_flags"], micro_batch_size=micro,
                global_batch_size=rec["micro_batch_per_rank"] * rec["world_size"],
                tensor_model_parallel_size=tp, zero_stage=stage, seed=7, **extra)


def hybrid_continues(ps, rec: dict, load: str, save: str, stage: int, steps: int,
                     export: str | None = None) -> list[float]:
    """On every rank: hybrid's GPT built as training builds it, started from ``load`` (a
    DCP checkpoint, imported into ``save``) through the run's own resume, then ``steps``
    steps on the recorded run's batches; the global losses. ``export``: afterwards save
    a hybrid checkpoint there at the last iteration (the way back's start)."""
    import torch.distributed as dist

    from benchmarks.peers import titan_llama as tl
    from hybrid.checkpoint import save_checkpoint
    from hybrid.checkpoint.resume import start_from_checkpoint
    from hybrid.config import Flags, build_config
    from hybrid.kernels import configure
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    from hybrid.train.step import train_step

    flags = _flags(rec, ps.tp_size, ps.world_size, stage, load=load, save=save)
    cfg = build_config(Flags(**flags), ps.world_size, environ=os.environ)
    configure(cfg.kernels)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device, ps.cp_rank, ps.tp_size)
    vocab = rec["shape"]["vocab_size"]
    model, _, engine = build_engine(cfg, ps, vocab, rng)
    model.train()
    start = start_from_checkpoint(cfg.checkpoint, engine, ps, cfg.seed, rng, vocab,
                                  cfg.to_dict())
    assert start is not None and start.iteration == rec["save_step"]
    s = tl.shape(**rec["shape"])
    dp = ps.world_size // ps.tp_size
    gb = flags["global_batch_size"]
    rows = slice(ps.dp_rank * gb // dp, (ps.dp_rank + 1) * gb // dp)
    losses = []
    for step in range(start.iteration + 1, start.iteration + 1 + steps):
        x, y = tl.batch(rec["seed"], step, s, gb)
        loss, _, _ = train_step(model, engine, [(x[rows], y[rows])], flags["lr"])
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t) / ps.world_size)
    engine.wait_optimizer()
    if export:
        save_checkpoint(export, start.iteration + steps, gb * (start.iteration + steps),
                        engine, ps, rng, config=cfg.to_dict(), vocab_size=vocab)
    return losses


def _max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("tp,stage", [(1, 3), (2, 1)])
def test_continues_the_recorded_run(tmp_path, tp, stage):
    """ZeRO 3 over 2 ranks (the fixture's FSDP2 layout) and TP 2: the 10 losses after the
    import equal torchtitan-style training's own within 2e-6."""
    rec = _record()
    ckpt = _unpack(tmp_path)
    out = run_ranks(hybrid_continues, world_size=2, tp=tp,
                    args=(rec, ckpt, str(tmp_path / "save"), stage, 10))
    want = rec["losses_after_save"]
    assert _max_diff(out[0], want) <= TOL, (out[0], want)
