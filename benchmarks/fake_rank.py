"""One process as the last rank of a large world, through torch's fake process group: what
the scale benches share (``bench_pipeline_scale``, ``bench_moe_scale``).

    with fake_world(1024) as rank: ...          # the default group, rank world - 1
    steps = timed_steps(cfg, ps, model, engine, 3, "p2p")
    records = abba(WORLDS, rounds, lambda world, steps: last_rank(world, ..., steps))

The fake group returns at once from every collective and send, and leaves a receive's
buffer as it was; each bench says what it puts there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from benchmarks.timing import median_of
from hybrid.kernels.dtypes import DTYPES
from hybrid.train.step import activation_shape, train_step

VOCAB = 257  # the byte tokenizer's


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[int]:
    """This process joins the fake default group of ``world`` ranks as rank ``world - 1``
    (yielded); the group is destroyed on the way out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    try:
        yield world - 1
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def filled_receives(fill: Callable[[torch.Tensor], object]) -> Iterator[None]:
    """Receives through the fake group leave their buffer as allocated: ``fill`` each
    received tensor after the (real) ``batch_isend_irecv`` call, as the peer's send would
    have."""
    real = dist.batch_isend_irecv

    def batch(ops):
        works = real(ops)
        for op in ops:
            if op.op is dist.irecv:
                fill(op.tensor)
        return works

    dist.batch_isend_irecv = batch
    try:
        yield
    finally:
        dist.batch_isend_irecv = real


def scale_args(doc: str, argv) -> argparse.Namespace:
    """The scale benches' command line (``--zero-stage``, ``--rounds``, ``--steps``; more
    with ``extra``), after which the process runs on one intra-op thread."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--hidden", type=int, default=None,
                    help="hidden size (default: the bench's own)")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    return a


def machine() -> dict:
    """What a scale bench's first record says of where it ran."""
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "threads": 1, "date": time.strftime("%Y-%m-%d")}


def timed_steps(cfg, ps, model, engine, steps: int, counted: str) -> dict:
    """``steps`` pipeline steps of ``cfg``'s batches (seeded token ids, micro-batch size
    and count of ``cfg``) through :func:`hybrid.train.step.train_step` at 1e-3:
    ``{"step_s", "losses", "skipped", counted + "_bytes_per_step"}``, the last the bytes of
    collective kind ``counted`` each step sent (``ps.comm_stats``)."""
    lp = cfg.loop
    gen = torch.Generator().manual_seed(cfg.seed)
    batches = [(torch.randint(0, VOCAB, (lp.micro_batch_size, cfg.model.seq_length),
                              generator=gen),) * 2 for _ in range(cfg.num_micro_batches)]
    dtype = DTYPES[cfg.precision.params_dtype]
    act = activation_shape(lp.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size,
                           ps, cfg.parallel.sequence_parallel)
    step_s, losses, sent = [], [], []
    skipped = False
    for _ in range(steps):
        ps.comm_stats.reset()
        t = time.perf_counter()
        loss, result, _ = train_step(model, engine, batches, 1e-3,
                                     schedule=cfg.pipeline.schedule, shape=act, dtype=dtype)
        step_s.append(time.perf_counter() - t)
        losses.append(float(loss))
        sent.append(ps.comm_stats.bytes[counted])
        skipped = skipped or bool(result.skipped)
    return {"step_s": step_s, "losses": losses, "skipped": skipped,
            f"{counted}_bytes_per_step": sent}


def abba(worlds: tuple[int, ...], rounds: int, steps: int,
         run: Callable[[int, int], dict]) -> dict[int, dict]:
    """``run(world, steps)`` once per world untimed (imports, lazy initializations, the
    allocator), then ``rounds`` times each, the worlds in turn and the order reversed
    every other round (ABBA); per world, its last record with ``setup_s``,
    ``setup_groups_s``, ``setup_model_s`` and ``step_s`` the medians over the rounds."""
    for world in worlds:
        run(world, 1)
    runs: dict[int, list[dict]] = {w: [] for w in worlds}
    for r in range(rounds):
        for world in (worlds if r % 2 == 0 else worlds[::-1]):
            runs[world].append(run(world, steps))
    records = {}
    for world in worlds:
        rec = dict(runs[world][-1])
        for part in ("setup_s", "setup_groups_s", "setup_model_s"):
            rec[part] = median_of(x[part] for x in runs[world])
        rec["step_s"] = median_of(s for x in runs[world] for s in x["step_s"])
        rec["setup_s_all"] = [round(x["setup_s"], 5) for x in runs[world]]
        records[world] = rec
    return records
