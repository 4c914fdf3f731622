#!/usr/bin/env python
"""Checkpoint I/O per rank: files, bytes and seconds of a save, a same-layout load and a
reshard, at several world sizes (ranks are local processes, gloo, CPU).

    python -m benchmarks.bench_checkpoint [--worlds 2 4 8] [--hidden-size 256] [--layers 4]

For each world size W, one session of W processes:

* save: a GPT at TP 2 x DP W/2, ZeRO-3, after one optimizer step (non-zero
  moments). Reported: the files this rank wrote and their bytes, the bytes it
  read meanwhile (``/proc/self/io`` rchar), seconds.
* load, same layout: into a fresh engine of the same layout. Reported from the
  load's :class:`hybrid.checkpoint.RangeReader`: files opened, bytes read, and
  ``ratio``, bytes read over the bytes of this rank's own files (header + data);
  ``exact``: the loaded master and moments equal the saved ones bit for bit;
  ``unverified_seconds``: the same load without checking the checksums,
  alternating with the checked one (``--repeat`` times each; ``checked_seconds``).
* reshard: into TP 1 x DP W at ZeRO-1 (TP and DP and stage change). Reported:
  files opened, bytes read, ``needed`` (12 bytes per fp32 [master, exp_avg,
  exp_avg_sq] element the rank now owns) and seconds.
* finetune: the same reshard loading the weights only (``--finetune``: no
  optimizer state, no RNG): ``needed`` is 4 bytes per element, the master.

Every phase also reports ``checksum_s``: the seconds of it spent computing and
checking the crc32 checksums (:mod:`hybrid.checkpoint.integrity`), what they add
to the phase's ``seconds``; loads report ``bytes_rechecked``, the bytes read only
to complete a checksum block the load read in part.

Seconds are wall time between barriers, with the files in the page cache (they
were just written); on this shared 2-core machine they are noisy. Prints one
JSON object. The 302M GPT of docs/measurements.md: ``--worlds 2 --layers 24
--hidden-size 1024 --heads 16 --no-reshard --repeat 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch

from benchmarks.timing import Stopwatch, rnd, world_barrier
from hybrid.testing.pool import run_ranks

VOCAB = 8000  # padded to 8192 at TP 1 and 2


def _engine(ps, model_args, stage, seed):
    from hybrid.config import Flags, build_config
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    cfg = build_config(Flags(tensor_model_parallel_size=ps.tp_size, zero_stage=stage, seed=seed,
                      hidden_dropout=0.0, attention_dropout=0.0,
                      **model_args), ps.world_size)
    rng = seed_all(seed, ps.tp_rank, ps.dp_rank, ps.device)
    model, _, engine = build_engine(cfg, ps, VOCAB, rng)
    return cfg, rng, model, engine


def _values(engine) -> torch.Tensor:
    from hybrid.zero.state import iter_piece_values
    parts = list(iter_piece_values(engine))
    return torch.cat(parts) if parts else torch.zeros(0, 3)


def _rchar_since(before: int | None) -> int | None:
    """Bytes through read-type syscalls since ``before`` (a ``process_rchar()``); None
    where ``/proc/self/io`` is not."""
    from hybrid.checkpoint.reader import process_rchar
    after = process_rchar()
    return None if before is None or after is None else after - before


def _load(ps, save, model_args, stage, verify=True, **load_kw):
    from hybrid.checkpoint import RangeReader, load_checkpoint
    from hybrid.checkpoint.reader import process_rchar
    cfg, rng, _, engine = _engine(ps, model_args, stage, seed=7)
    reader = RangeReader(verify=verify)
    before = process_rchar()
    with Stopwatch(barrier=world_barrier(ps)) as sw:
        load_checkpoint(save, engine, ps, cfg.seed, rng, VOCAB, reader=reader, **load_kw)
    rchar = _rchar_since(before)
    files = sorted({os.path.basename(p) for p in reader.files_opened})
    return engine, {"files_opened": len(reader.files_opened), "files": files,
                    "bytes_read": reader.bytes_read, "rchar": rchar,
                    "bytes_rechecked": reader.bytes_rechecked,
                    "seconds": rnd(sw.seconds, 4),
                    "checksum_s": round(reader.checksum_seconds(), 4)}


def _session(ps, root, model_args, reshard=True, repeat=1) -> dict:
    from hybrid.checkpoint import save_checkpoint
    from hybrid.checkpoint.reader import process_rchar
    from hybrid.parallel.state import ParallelState
    save = os.path.join(root, "ckpt")
    cfg, rng, model, engine = _engine(ps, model_args, 3, seed=3)
    tokens = torch.randint(0, VOCAB, (2, model_args["seq_length"] + 1),
                           generator=torch.Generator().manual_seed(ps.dp_rank))
    engine.zero_grad()
    engine.backward(model(tokens[:, :-1], tokens[:, 1:]))
    engine.step(1e-3)
    before = process_rchar()
    info: dict = {}
    with Stopwatch(barrier=world_barrier(ps)) as sw:
        ckpt = save_checkpoint(save, 1, 8, engine, ps, cfg.to_dict(), rng, vocab_size=VOCAB,
                               info=info)
    rchar = _rchar_since(before)
    own = [os.path.join(ckpt, f"rank_{ps.rank:05d}{e}") for e in (".pt", ".bin")]
    if ps.rank == 0:
        own.append(os.path.join(ckpt, "metadata.json"))
    own_bytes = sum(os.path.getsize(p) for p in own[:2])
    out = {"save": {"files_written": len(own) + (ps.rank == 0),  # + 'latest' on rank 0
                    "bytes_written": sum(os.path.getsize(p) for p in own),
                    "bytes_read": rchar, "seconds": rnd(sw.seconds, 4),
                    "checksum_s": round(info["checksum_seconds"], 4)}}
    saved = _values(engine)
    del engine, model

    loaded, same = _load(ps, save, model_args, 3)
    same["own_file_bytes"] = own_bytes
    same["ratio"] = round(same["bytes_read"] / own_bytes, 4)
    same["exact"] = torch.equal(_values(loaded), saved)
    out["load_same_layout"] = same
    del loaded, saved
    # what checking adds: the same load without checking, alternating with the checked
    # one (``repeat`` times each; the other figures are the first checked load's)
    checked, unverified = [same["seconds"]], []
    for i in range(repeat):
        unverified.append(_load(ps, save, model_args, 3, verify=False)[1]["seconds"])
        if i + 1 < repeat:
            checked.append(_load(ps, save, model_args, 3)[1]["seconds"])
    same["checked_seconds"], same["unverified_seconds"] = checked, unverified
    if not reshard:
        return out

    tp1 = ParallelState.build(1, timeout=ps.timeout, device=ps.device)
    loaded, re = _load(tp1, save, model_args, 1)
    re["needed"] = 12 * sum(pc.numel for pc in loaded.owned_pieces())
    out["reshard"] = re
    del loaded
    loaded, ft = _load(tp1, save, model_args, 1, load_optim=False, load_rng=False)
    ft["needed"] = re["needed"] // 3
    out["finetune"] = ft
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ranks", action="store_true", help="also list every rank's record")
    ap.add_argument("--repeat", type=int, default=1,
                    help="same-layout loads with and without checking, each this many times")
    ap.add_argument("--no-reshard", action="store_true",
                    help="only the save and the same-layout load (a model whose TP 1 engine "
                         "would not fit this machine's memory twice)")
    a = ap.parse_args(argv)
    model_args = {"num_layers": a.layers, "hidden_size": a.hidden_size,
                  "num_attention_heads": a.heads, "seq_length": a.seq_length}
    report: dict[str, Any] = {"model": dict(model_args, vocab_size=VOCAB), "runs": []}
    for world in a.worlds:
        with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as root:
            ranks = run_ranks(_session, world_size=world, tp=2,
                              args=(root, model_args, not a.no_reshard, a.repeat),
                              timeout=1800)
        run = {"world": world, "saved_as": f"TP2 x DP{world // 2} ZeRO-3",
               "resharded_to": f"TP1 x DP{world} ZeRO-1"}
        for phase in ("save", "load_same_layout", "reshard", "finetune"):
            if phase in ranks[0]:
                run[phase] = _summary([r[phase] for r in ranks])
        run["load_same_layout"]["max_ratio"] = max(r["load_same_layout"]["ratio"]
                                                   for r in ranks)
        run["load_same_layout"]["all_exact"] = all(r["load_same_layout"]["exact"]
                                                   for r in ranks)
        for k in ("checked_seconds", "unverified_seconds"):  # rank 0's (barrier-timed)
            run["load_same_layout"][k] = ranks[0]["load_same_layout"][k]
        for phase in ("reshard", "finetune") if not a.no_reshard else ():
            run[phase]["max_read_over_needed"] = round(max(
                r[phase]["bytes_read"] / r[phase]["needed"] for r in ranks), 4)
        if a.ranks:
            run["per_rank"] = ranks
        report["runs"].append(run)
    # One line per phase: readable, and still one JSON object.
    runs = ",\n".join("  {" + ",\n   ".join(f"{json.dumps(k)}: {json.dumps(v)}"
                                             for k, v in run.items()) + "}"
                       for run in report["runs"])
    print(f'{{"model": {json.dumps(report["model"])},\n "runs": [\n{runs}]}}')
    return 0


def _summary(records: list[dict]) -> dict:
    """Per-rank lists of the numeric fields (rank order), files opened by rank 0."""
    out = {}
    for k, v in records[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = [r[k] for r in records]
    if "files" in records[0]:
        out["rank0_files"] = records[0]["files"]
    return out


if __name__ == "__main__":
    sys.exit(main())
