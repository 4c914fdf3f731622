#!/usr/bin/env python
"""What each offload tier costs: step time, memory and disk of one GPT, as one JSON object.

    python -m benchmarks.bench_offload [--world-size 1] [--steps 5] [--nvme-path DIR]
    python -m benchmarks.bench_offload --layers 2 --hidden 256 --steps 2      # a quick look
    python -m benchmarks.bench_offload --largest --hidden 4096 --configs param_cpu param_nvme

One GPT (default 8 layers x hidden 1024, vocab 8192: ~109M parameters; seq 128,
micro-batch 1, ``--dtype`` (default bf16 with a GPU, fp32 without: a CPU without
bf16 matrix units multiplies bf16 hundreds of times slower), TP 1, DP
``--world-size``, ZeRO-3, synthetic tokens) under each setting, in fresh
processes (``run_ranks(reuse=False)``) so the peak RSS is that setting's:
``none``, ``optimizer_cpu``, ``optimizer_nvme``, ``param_cpu`` (optimizer cpu +
param cpu), ``param_nvme`` (optimizer nvme + param nvme), ``param_nvme_gds``
(the same with ``--offload-gds``; its row's ``gds_per_rank`` says "used" or why
not -- not in the default list). Swap files go to a fresh directory under
``--nvme-path`` (default: the current directory; tmpfs is refused), removed at
the end.

``configs.<name>``: ``median_step_s`` (``--steps`` after one warm-up) and
``ratio_to_none``, split into ``median_fwd_bwd_s`` and ``median_optimizer_step_s``
(engine.step); nvme only, ``median_io_wait_s`` (blocked in swap waits);
``peak_rss_mb_per_rank`` (ru_maxrss); ``model_state_bytes_per_rank``
(``engine.model_state_bytes()``, disk included); ``predicted``: the estimator's
device/host/disk bytes per rank (``tier_bytes``; on a CPU host_bytes is the
whole process) and ``peak_rss_over_predicted_host``. A setting the config or
the engine refuses is ``{"skipped": reason}``. Each row also names its ``layers`` and ``params``,
and ``tflops_per_rank`` (``ModelConfig.flops_per_token`` x the step's tokens
over the median step); on a GPU ``peak_device_bytes_per_rank``
(``torch.cuda.max_memory_allocated``: no CUDA context or NCCL buffers) and
``peak_device_over_predicted``. ``--micro-batches k`` accumulates k
micro-batches per step. ``--largest``: per setting, the most ``--hidden``-wide
layers the estimator fits on this machine (GPU memory, available host memory,
free disk at ``--nvme-path``, each times ``--fit-margin``), before anything is
built: the largest GPT each tier trains here.

``swap_io`` (optimizer_nvme's rank 0, after every rank's steps): ``rw_GBps``:
one ``engine.swapped.run`` of the states with a no-op update (reads and writes
every tile, 2 x ``file_bytes``); ``read_GBps``: every tile
read through ``swapped.io.read``, C in flight; ``dd``: ``bench_aio.bench_dd``
on the same directory (direct I/O where the file system allows; one stream of
8 MiB blocks); ``ratio_rw_to_dd`` (against dd's read and write of the same bytes
back to back) and ``ratio_read_to_dd``; goal >= 0.8. ``nvme_vs_cpu_step``:
engine.step of optimizer_nvme over optimizer_cpu (goal <= 1.5 where the disk
allows); ``disk_bound_s`` = 16 B x shard / dd read + 12 B x shard / dd write
(28 B per shard element moved: the states in and out, the fp32 gradient in),
the step's I/O at dd's bandwidth (one rank's; N ranks on one disk take N
times); ``disk_bound_whole_tiles_s`` the same for the bytes the step really
moves (whole tiles: 2 x ``file_bytes`` and ``grad_file_bytes`` in).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

from benchmarks import bench_aio as aio
from benchmarks.timing import Stopwatch, emit, median_of, now, peak_rss_mb
from hybrid.config import Flags, build_config
from hybrid.kernels.aio import Request
from hybrid.testing.pool import run_ranks

CONFIGS = {"none": (None, None), "optimizer_cpu": ("cpu", None),
           "optimizer_nvme": ("nvme", None), "param_cpu": ("cpu", "cpu"),
           "param_nvme": ("nvme", "nvme"), "param_nvme_gds": ("nvme", "nvme")}


def _config(a, name, swap_dir, world, layers=None):
    optimizer, param = CONFIGS[name]
    return build_config(Flags(
        num_layers=layers or a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        seq_length=a.seq_length, micro_batch_size=a.micro_batch_size, bf16=a.dtype == "bf16",
        global_batch_size=a.micro_batch_size * a.micro_batches * world,
        hidden_dropout=0.0, attention_dropout=0.0, lr=1e-4, weight_decay=0.01, clip_grad=1.0,
        zero_stage=3, zero_param_persistence_threshold=0, seed=1234,
        offload_optimizer=optimizer, offload_param=param,
        offload_nvme_path=os.path.join(swap_dir, name) if "nvme" in (optimizer, param) else None,
        offload_buffer_count=a.buffer_count, offload_buffer_size=a.buffer_size,
        offload_gds=name.endswith("_gds")), world)


class _WaitClock:
    """Seconds spent in ``wait()`` of the requests an AsyncIO hands out from now on."""

    def __init__(self, io):
        self.s = 0.0
        io.read, io.write = self._timed(io.read), self._timed(io.write)

    def _timed(self, submit):
        def call(*args):
            req = submit(*args)
            wait = req.wait

            def timed_wait():
                t = now()
                try:
                    wait()
                finally:
                    self.s += now() - t
            req.wait = timed_wait
            return req
        return call


def _swap_rates(sw) -> dict:
    """I/O of the swapped states alone: a pass over every tile that updates none, then a
    read-only pass."""
    nbytes = sw.tiles * 12 * sw.tile
    grads, sw.grads = sw.grads, None  # (the states' pass only)
    try:
        with Stopwatch() as rw_pass:
            for _ in sw.each():  # read and write every tile, update none
                pass
    finally:
        sw.grads = grads
    rw = rw_pass.seconds
    c = len(sw.staging)
    pending: dict[int, Request] = {}  # staging buffer -> its read
    with Stopwatch() as read_pass:
        for k in range(sw.tiles):  # tile k is the 12 T bytes at offset 12 T k
            if k % c in pending:
                pending.pop(k % c).wait()
            pending[k % c] = sw.io.read(sw.file, k * 12 * sw.tile, sw.staging[k % c])
        for r in pending.values():
            r.wait()
    read = read_pass.seconds
    return {"file_bytes": nbytes, "shard_elements": sw.n, "tiles": sw.tiles,
            "grad_file_bytes": 0 if grads is None else sw.tiles * grads.slot_bytes,
            "rw_pass_s": rw, "rw_GBps": 2 * nbytes / rw / 1e9,
            "read_pass_s": read, "read_GBps": nbytes / read / 1e9}


def _time_steps(a, ps, cfg, model, engine) -> dict:
    """Per timed step: forward+backward of ``--micro-batches`` micro-batches,
    engine.step, and the step's I/O waits."""
    clock = _WaitClock(engine.swapped.io) if engine.swapped is not None else None
    g = torch.Generator().manual_seed(100 + ps.dp_rank)
    out: dict[str, list[float]] = {"fwd_bwd": [], "step": [], "io_wait": []}
    k = a.micro_batches
    for i in range(1 + a.steps):  # the first is the warm-up
        data = torch.randint(0, a.vocab_size, (k, a.micro_batch_size, a.seq_length + 1),
                             generator=g).to(ps.device)
        t0 = now(ps.device)
        engine.zero_grad()
        for j, b in enumerate(data):
            engine.backward(model(b[:, :-1], b[:, 1:]) / k, sync=j == k - 1)
        t1 = now(ps.device)
        waited = clock.s if clock else 0.0
        engine.step(cfg.lr_schedule.lr)
        t2 = now(ps.device)
        if i > 0:
            out["fwd_bwd"].append(t1 - t0)
            out["step"].append(t2 - t1)
            out["io_wait"].append((clock.s if clock else 0.0) - waited)
    return out


def _bench_rank(ps, name, a, swap_dir):
    """One rank of setting ``name``: its timings, peak RSS, bytes, and the prediction."""
    from hybrid.errors import ConfigError
    from hybrid.estimate.memory import workload
    from hybrid.estimate.tiers import tier_bytes
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    torch.set_num_threads(a.threads)
    try:
        cfg = _config(a, name, swap_dir, ps.world_size, a.layers_of.get(name))
    except ConfigError as e:
        return {"skipped": f"config refused: {e}"}
    if ps.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ps.device)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    try:
        model, _, engine = build_engine(cfg, ps, a.vocab_size, rng)
    except Exception as e:  # noqa: BLE001 - a tier the engine cannot build is reported
        return {"skipped": f"engine refused: {type(e).__name__}: {e}"}
    try:
        out = _time_steps(a, ps, cfg, model, engine)
        ps.world_group.all_reduce(torch.zeros(1))  # every rank done: rank 0's disk alone
        if name == "optimizer_nvme" and ps.rank == 0:
            out["swap_io"] = _swap_rates(engine.swapped)
        out["model_state_bytes"] = engine.model_state_bytes()
        if cfg.offload.gds:  # did the probe pass (hybrid/zero/offload/nvme/gds.py)?
            out["gds"] = engine.tiers.gds or "used"
    finally:
        engine.close()
    est = tier_bytes(workload(cfg, a.vocab_size, device=ps.device.type), cfg.offload)
    out["predicted"] = {k: est[k] for k in ("device_bytes", "host_bytes", "disk_bytes")}
    out["params"] = sum(p.numel() for p in model.parameters())
    out["layers"] = cfg.model.num_layers
    out["flops_per_step"] = (cfg.model.with_vocab_size(a.vocab_size).flops_per_token()
                             * a.micro_batches * a.micro_batch_size * a.seq_length)
    out["peak_rss_mb"] = peak_rss_mb()
    if ps.device.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(ps.device)
    return out


def _capacity(a, device: str):
    """This machine's room, times ``--fit-margin``: the GPU's memory (none on a CPU),
    the host's available memory, the free disk at ``--nvme-path``; every rank here."""
    from hybrid.estimate.tiers import Capacity
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f
                     if line.startswith("MemAvailable:"))
    gpu = torch.cuda.mem_get_info()[1] if device == "cuda" else None
    m = a.fit_margin
    return Capacity(device_bytes=None if gpu is None else gpu * m, host_bytes=avail * m,
                    nvme_bytes=shutil.disk_usage(a.nvme_path).free * m,
                    ranks_per_node=a.world_size)


def largest_layers(a, name: str, swap_dir: str, device: str) -> int:
    """The most ``--hidden``-wide layers the estimator says fit this machine under
    setting ``name`` (0: not even one)."""
    from hybrid.estimate.memory import workload
    from hybrid.estimate.tiers import largest_fitting, shortfalls, tier_bytes
    cap = _capacity(a, device)

    def fits(layers: int) -> bool:
        cfg = _config(a, name, swap_dir, a.world_size, layers)
        est = tier_bytes(workload(cfg, a.vocab_size, device=device), cfg.offload)
        return not shortfalls(est, cap)
    return largest_fitting(fits)


def _run_config(a, name, swap_dir) -> list[dict]:
    try:
        return run_ranks(_bench_rank, a.world_size, 1, args=(name, a, swap_dir),
                         timeout=1800, reuse=False)
    except Exception as e:  # noqa: BLE001 - one setting failing leaves the others' figures
        return [{"skipped": f"failed: {type(e).__name__}: {str(e)[-2000:]}"}]


def _summary(ranks: list[dict], none_s: float | None) -> dict:
    if "skipped" in ranks[0]:
        return {"skipped": ranks[0]["skipped"]}
    med = median_of(f + s for r in ranks for f, s in zip(r["fwd_bwd"], r["step"]))
    pred = ranks[0]["predicted"]
    rss = [round(r["peak_rss_mb"], 1) for r in ranks]
    row = {"layers": ranks[0]["layers"], "params": ranks[0]["params"],
           "median_step_s": round(med, 4),
           "ratio_to_none": round(med / none_s, 3) if none_s else None,
           "tflops_per_rank": round(ranks[0]["flops_per_step"] / med / 1e12, 4),
           "median_fwd_bwd_s": round(median_of(t for r in ranks for t in r["fwd_bwd"]), 4),
           "median_optimizer_step_s": round(median_of(
               t for r in ranks for t in r["step"]), 4)}
    if ranks[0]["model_state_bytes"]["disk"]:
        row["median_io_wait_s"] = round(median_of(
            t for r in ranks for t in r["io_wait"]), 4)
    row.update(peak_rss_mb_per_rank=rss,
               model_state_bytes_per_rank=[r["model_state_bytes"] for r in ranks],
               predicted=pred,
               peak_rss_over_predicted_host=round(max(rss) * 2**20 / pred["host_bytes"], 3))
    if "peak_device_bytes" in ranks[0]:  # (allocated by torch: no CUDA context, no NCCL)
        dev = [r["peak_device_bytes"] for r in ranks]
        row.update(peak_device_bytes_per_rank=dev,
                   peak_device_over_predicted=round(max(dev) / pred["device_bytes"], 3))
    if "gds" in ranks[0]:
        row["gds_per_rank"] = [r["gds"] for r in ranks]
    return row


def _io_report(swap: dict, directory: str, reps: int) -> dict:
    """The swapper's rates beside dd's on the same directory."""
    nbytes = max(aio.BLOCK, swap["file_bytes"] // aio.BLOCK * aio.BLOCK)
    direct = aio._direct_ok(directory)
    dd = aio.bench_dd(directory, nbytes, direct, reps)
    dd_rw = 2 / (1 / dd["read_GBps"] + 1 / dd["write_GBps"])  # read then write the same bytes
    return {**{k: round(v, 4) if isinstance(v, float) else v for k, v in swap.items()},
            "dd": {**{k: round(v, 3) for k, v in dd.items()}, "bytes": nbytes, "direct": direct},
            "ratio_rw_to_dd": round(swap["rw_GBps"] / dd_rw, 3),
            "ratio_read_to_dd": round(swap["read_GBps"] / dd["read_GBps"], 3), "goal": ">= 0.8"}


def _step_report(configs: dict, io: dict | None) -> dict:
    cpu, nvme = configs["optimizer_cpu"], configs["optimizer_nvme"]
    if "skipped" in cpu or "skipped" in nvme:
        return {"skipped": "optimizer_cpu or optimizer_nvme did not run"}
    cpu_s, nvme_s = cpu["median_optimizer_step_s"], nvme["median_optimizer_step_s"]
    row = {"cpu_step_s": cpu_s, "nvme_step_s": nvme_s, "ratio": round(nvme_s / cpu_s, 3),
           "goal": "<= 1.5 where the disk allows"}
    if io and "dd" in io:
        r, w = io["dd"]["read_GBps"] * 1e9, io["dd"]["write_GBps"] * 1e9
        bound = io["shard_elements"] * (16 / r + 12 / w)
        row.update(disk_bound_s=round(bound, 4),
                   disk_bound_whole_tiles_s=round(io["file_bytes"] * (1 / r + 1 / w)
                                                  + io["grad_file_bytes"] / r, 4),
                   disk_bound_over_cpu_step=round(bound / cpu_s, 3),
                   disk_allows_goal=bound <= 1.5 * cpu_s)
    return row


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=1, help="DP ranks (TP is 1)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--largest", action="store_true",
                    help="per setting, the most --hidden-wide layers the estimator says fit "
                         "this machine (GPU, available host memory, free disk at --nvme-path)")
    ap.add_argument("--fit-margin", type=float, default=0.85,
                    help="with --largest: the share of each capacity a setting may use")
    ap.add_argument("--dtype", choices=("fp32", "bf16"),
                    default="bf16" if torch.cuda.is_available() else "fp32")
    ap.add_argument("--steps", type=int, default=5, help="timed steps, after one warm-up")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (default: cores / world size)")
    ap.add_argument("--buffer-count", type=int, default=Flags.offload_buffer_count)
    ap.add_argument("--buffer-size", type=int, default=Flags.offload_buffer_size)
    ap.add_argument("--nvme-path", default=os.getcwd(),
                    help="where the swap directory goes (default: the current directory)")
    ap.add_argument("--dd-reps", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=[c for c in CONFIGS if c != "param_nvme_gds"],
                    choices=list(CONFIGS))
    a = ap.parse_args(argv)
    a.threads = a.threads or max(1, (os.cpu_count() or 1) // a.world_size)
    a.layers_of = {}  # per setting, with --largest
    return ap, a


def main(argv=None) -> int:
    ap, a = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    point, fstype = aio._mount(a.nvme_path)
    if fstype in ("tmpfs", "ramfs"):
        ap.error(f"--nvme-path {a.nvme_path} is on {fstype} (memory), not a disk")
    swap_dir = tempfile.mkdtemp(prefix=".bench_offload-", dir=a.nvme_path)
    configs: dict[str, dict] = {}
    io: dict | None = None
    try:
        if a.largest:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            a.layers_of = {n: largest_layers(a, n, swap_dir, device) for n in a.configs}
        runs: dict[str, list[dict]] = {
            name: _run_config(a, name, swap_dir) if a.layers_of.get(name, 1)
            else [{"skipped": "--largest: not even one layer fits"}]
            for name in a.configs}
        none = runs.get("none", [{"skipped": ""}])[0]
        none_s = None if "skipped" in none else median_of(
            f + s for f, s in zip(none["fwd_bwd"], none["step"]))
        configs = {name: _summary(r, none_s) for name, r in runs.items()}
        swap = runs.get("optimizer_nvme", [{}])[0].get("swap_io")
        if swap:
            io = _io_report(swap, swap_dir, a.dd_reps)
    finally:
        shutil.rmtree(swap_dir, ignore_errors=True)
    first = next((r[0] for r in runs.values() if "params" in r[0]), {})
    report = {"command": " ".join([os.path.basename(__file__), *(argv or sys.argv[1:])]),
              "model": {"params": first.get("params"), "layers": a.layers_of or a.layers,
                        "hidden": a.hidden, "micro_batches": a.micro_batches,
                        "vocab": a.vocab_size, "seq_length": a.seq_length,
                        "micro_batch_size": a.micro_batch_size, "dtype": a.dtype, "zero_stage": 3,
                        "tp": 1, "dp": a.world_size, "threads_per_rank": a.threads},
              "nvme_path": os.path.realpath(a.nvme_path), "mount": point, "fs": fstype,
              "configs": configs, "swap_io": io}
    if "optimizer_cpu" in configs and "optimizer_nvme" in configs:
        report["nvme_vs_cpu_step"] = _step_report(configs, io)
    emit(report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
