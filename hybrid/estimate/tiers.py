"""The offload tiers: what one rank keeps on the device, in host memory and on disk,
what a step moves over PCIe and to and from disk, and the cheapest setting that fits.

:func:`tier_bytes` adds up one rank's bytes in each place for an
:class:`~hybrid.config.sections.OffloadConfig` (``--offload-optimizer``,
``--offload-param``); :func:`pcie_bytes_per_step` and :func:`disk_bytes_per_step`
give the traffic; :func:`offload_ladder` walks the settings from the cheapest
(:data:`LADDER`) and :func:`recommend_offload` takes the first that fits the
device, host and disk capacities (``scripts/estimate_memory.py``).

[Note: offload tiers]
Per rank: Psi = this TP rank's parameters, N = ZeRO's ranks (DP x CP), shard = ceil(Psi / N)
elements, e_p = bytes per element of the params dtype (2 bf16/fp16, 4 fp32),
e_g = of the gradient dtype (4 with fp32 accumulation, the default under bf16;
else e_p), C x T = the nvme tier's staging: ``--offload-buffer-count`` buffers
of ``--offload-buffer-size`` elements (one tile each), k = micro-batches per
step, G = gather passes per micro-batch (forward, backward: 2; 3 with full
recompute, whose recompute forward gathers again)::

    device  params               the stage's (model_states.py); 0 with param offload
            grads                the stage's; with the optimizer offloaded at stages
                                 2-3, 2 landing buffers of the largest unit's shard,
                                 e_g each (zero/offload/landing.py; on a CPU device only
                                 with the delayed update, else the shard is the host
                                 buffer)
            optimizer            12 Psi / N (8 with fp32 params); 0 when offloaded
            gathered units       stage 3: :func:`buffer_bytes`'s root + 2 blocks; with
                                 param offload 3 x largest unit x e_p (the one computed,
                                 up to 2 prefetched); a pipeline step holding its stage
                                 (the default at PP > 1): e_p Psi either way
            param_reads          param nvme with --offload-gds: the host's
                                 param_staging, in device memory instead
            unit grads, staging, activations, runtime: as without offload
    host    master_and_moments   optimizer cpu: 12 shard (fp32 master, both moments)
            grad_buffer          optimizer cpu: e_g shard (0 on a CPU device at stages
                                 2-3 without the delayed update: the engine's flat
                                 gradient shard is that host buffer, already counted
                                 as the device's grads)
            grad_staging         optimizer nvme (the gradients go to grads.swp): 2
                                 largest-unit shards, e_g each, + C slots of T e_g
                                 (each 4096-aligned; the step's gradient tiles)
            upload_copy          optimizer offload without param offload (or with the
                                 delayed update): e_p shard (the new parameters on
                                 their way up; none on the cpu tier with fp32 params,
                                 which uploads its master)
            optimizer_staging    optimizer nvme: C T 12 (a tile's master and moments)
            param_shard          param cpu: e_p shard (also where the step writes the
                                 new parameters: it replaces the upload copy)
            param_staging        param nvme: 2 shards of the largest unit, e_p each
                                 (the read being loaded, the one prefetched); 0 with
                                 --offload-gds (assumed to work where asked)
            param_write_staging  param offload without the delayed update: the step
                                 writes new parameters home through 2 chunks, e_p
                                 each (zero/offload/writer.py): a tile (optimizer nvme) or
                                 the largest unit's shard (optimizer cpu, param nvme;
                                 none with param cpu: the step writes in place)
            baseline             the process itself (torch, the interpreter)
    disk    optimizer_swap       optimizer nvme: 12 T ceil(shard / T) (whole tiles)
            grad_swap            optimizer nvme: e_g T ceil(shard / T) (aligned slots)
            param_swap           param nvme: e_p shard
    PCIe    grads_down           optimizer offload: e_g shard per step; k e_g shard at
    (GPU,                        stages 2-3 (every micro-batch's sum lands and goes down)
    per     grads_up             stages 2-3: (k - 1) e_g shard (a partial sum back up
    step)                        to add the next micro-batch to)
            params_up            optimizer offload without param offload: e_p shard
            param_gathers_up     param offload: k G e_p shard (every gather uploads it);
                                 e_p shard under a pipeline step holding its stage
                                 (one gather a step; G k with
                                 --pipeline-reshard-after-micro-batch)
    disk    optimizer_read/write optimizer nvme: 12 shard each
    per     grad_write           optimizer nvme: e_g shard per micro-batch at stages 2-3
    step                         (every sum lands and goes down), once at stage 1
            grad_read            optimizer nvme: the step's e_g shard + (k - 1) e_g
                                 shard of partial sums read back at stages 2-3
    per     param_read           param nvme: k G e_p shard (a pipeline step holding
                                 its stage: e_p shard)
    step    param_write          param nvme: e_p shard (the step's new parameters)

On a machine without a GPU the "device" is host memory: the process's host
bytes are the device's and the host's terms together, and nothing crosses PCIe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybrid.config.sections import OffloadConfig
from hybrid.estimate.memory import Workload, activation_bytes, buffer_bytes
from hybrid.estimate.model_states import BYTES, model_state_bytes

# The process before the model, in host memory: the VmRSS (and ru_maxrss) of
# `python -c "import torch, hybrid.zero"`, measured on this repository's 2-core
# CPU machine with torch 2.13 (CPU build): 226,300 KiB, three runs within 0.1%.
HOST_BASELINE_BYTES = 226_300 * 1024

# (optimizer, param) from the cheapest -- least traffic off the device -- to the most
# offloaded. The param tiers run at ZeRO stage 3 only.
LADDER = ((None, None), ("cpu", None), ("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme"))


def setting_name(optimizer: str | None, param: str | None) -> str:
    """``"none"``, ``"optimizer cpu"``, ``"optimizer nvme + param nvme"``..."""
    parts = [f"{kind} {tier}" for kind, tier in (("optimizer", optimizer), ("param", param))
             if tier]
    return " + ".join(parts) or "none"


def _largest_unit(w: Workload) -> int:
    """Parameters of the largest stage-3 unit (a block, or what the root keeps: with PP
    the stage's share of it)."""
    m = w.model
    return max(m.block_parameters(w.tp), w.root_psi)


def shard_elements(w: Workload) -> int:
    """This rank's 1/N of the TP rank's parameters, rounded up."""
    return -(-w.psi // w.shard_ranks)


def _element_bytes(w: Workload) -> tuple[int, int]:
    """(e_p, e_g): bytes per parameter and per gradient element."""
    return BYTES[w.params_dtype], BYTES[w.grads_dtype or w.params_dtype]


def lands_grads(w: Workload, off: OffloadConfig) -> bool:
    """The device keeps no gradient shard: they land in 2 buffers and go down
    (the engine's rule, hybrid/zero/engine.py)."""
    return bool(off.optimizer) and w.zero_stage >= 2 and (
        w.device != "cpu" or off.delayed_update or off.optimizer == "nvme")


def landing_bytes(w: Workload) -> int:
    """The 2 landing buffers: the largest unit's shard each, in the gradient dtype. The
    largest unit: a block or the root at stage 3; at stage 2 a bucket, or the word
    embedding when it is larger (a parameter larger than a bucket is a unit alone)."""
    if w.zero_stage >= 3:
        unit = _largest_unit(w)
    else:
        unit = max(min(w.reduce_bucket_size, w.psi),
                   w.padded_vocab_size * w.model.hidden_size // w.tp)
    return 2 * -(-unit // w.shard_ranks) * _element_bytes(w)[1]


def gather_passes(w: Workload) -> int:
    """Gathers of each unit per micro-batch: forward, backward, and with full
    recompute the recompute forward (G in the note)."""
    return 3 if w.recompute else 2


def gathers_per_step(w: Workload) -> int:
    """Gathers of each unit per optimizer step: k G, or one under a pipeline step that
    holds its stage (:attr:`Workload.holds_stage`; recompute's forward finds it whole)."""
    return 1 if w.holds_stage else w.micro_batches * gather_passes(w)


def device_terms(w: Workload, off: OffloadConfig, runtime_bytes: int = 0) -> dict:
    """The device's bytes at its peak, by term (see the note)."""
    states = model_state_bytes(w.psi, w.shard_ranks, w.zero_stage, w.params_dtype,
                               w.grads_dtype)
    bufs = buffer_bytes(w)
    out = {"runtime": runtime_bytes, "params": states["params"], "grads": states["grads"],
           "optimizer": 0 if off.optimizer else states["optimizer"],
           "gathered_units": bufs["gathered"], "unit_grads": bufs["grads"],
           "reduce_staging": bufs["staging"], "activations": activation_bytes(w)["peak"]}
    if lands_grads(w, off):
        out["grads"] = landing_bytes(w)
    if off.param:
        # the shard lives off the device; only the unit being computed and up to two
        # prefetched ones are whole here (a pipeline step holding its stage: all of it)
        e_p = BYTES[w.params_dtype]
        whole = w.psi if w.holds_stage else 3 * _largest_unit(w)
        out.update(params=0, gathered_units=whole * e_p)
    if off.param == "nvme" and off.gds:  # GPUDirect reads land in device buffers
        out["param_reads"] = _param_reads(w)
    return out


def _param_reads(w: Workload) -> int:
    """Bytes of the reads from params.swp in flight: the shard being loaded and the one
    prefetched (hybrid/zero/offload/nvme/homes.py), each of the largest unit."""
    return 2 * -(-_largest_unit(w) // w.shard_ranks) * BYTES[w.params_dtype]


def host_terms(w: Workload, off: OffloadConfig, baseline_bytes: int = HOST_BASELINE_BYTES
               ) -> dict:
    """Host memory this rank holds for its model states, by term (see the note)."""
    n = shard_elements(w)
    e_p, e_g = _element_bytes(w)
    tile_pool = off.buffer_count * off.tile(n)
    # (on a CPU at stages 2-3 the host step reads the device's shard in place)
    in_place = w.zero_stage >= 2 and not lands_grads(w, off)
    return {
        "baseline": baseline_bytes,
        # fp32 master and both Adam moments, the whole shard
        "master_and_moments": 12 * n if off.optimizer == "cpu" else 0,
        # this step's reduced gradient shard, what the host step reads
        "grad_buffer": e_g * n if off.optimizer == "cpu" and not in_place else 0,
        # the nvme tier's gradients on their way to and from grads.swp (nvme/grads.py)
        "grad_staging": (landing_bytes(w) + off.buffer_count * _grad_slot(w, off)
                         if off.optimizer == "nvme" else 0),
        # the step's new parameters in the params dtype, before they go up (the cpu
        # tier uploads an fp32 master itself; the nvme tier has no master in memory)
        "upload_copy": e_p * n if (off.optimizer and (not off.param or off.delayed_update)
                                   and (w.params_dtype != "fp32" or off.optimizer == "nvme"))
        else 0,
        # C tiles of master + both moments (hybrid/zero/offload/nvme/tiles.py)
        "optimizer_staging": tile_pool * 12 if off.optimizer == "nvme" else 0,
        # the parameter shard's home between its gathers
        "param_shard": e_p * n if off.param == "cpu" else 0,
        # reads from params.swp in flight: the shard being loaded and the one
        # prefetched (hybrid/zero/offload/nvme/homes.py), each of the largest unit
        "param_staging": _param_reads(w) if off.param == "nvme" and not off.gds else 0,
        "param_write_staging": 2 * _write_chunk(w, off) * e_p,
    }


def _write_chunk(w: Workload, off: OffloadConfig) -> int:
    """Elements of one of the home writer's 2 scratch chunks (0: it needs none)."""
    if not off.param or off.delayed_update:
        return 0  # no home writer: the new parameters go through the upload copy
    if off.optimizer == "nvme":  # tiles straddle units
        return min(off.tile(shard_elements(w)), shard_elements(w))
    return -(-_largest_unit(w) // w.shard_ranks) if off.param == "nvme" else 0


def _grad_slot(w: Workload, off: OffloadConfig) -> int:
    """Bytes of one tile's gradient in grads.swp: T e_g, 4096-aligned."""
    return -(-off.tile(shard_elements(w)) * _element_bytes(w)[1] // 4096) * 4096


def disk_terms(w: Workload, off: OffloadConfig) -> dict:
    """Bytes this rank keeps in its swap files, by term (see the note)."""
    n = shard_elements(w)
    tiles = -(-n // off.tile(n))
    nvme = off.optimizer == "nvme"
    return {"optimizer_swap": 12 * tiles * off.tile(n) if nvme else 0,
            "grad_swap": tiles * _grad_slot(w, off) if nvme else 0,
            "param_swap": BYTES[w.params_dtype] * n if off.param == "nvme" else 0}


def pcie_bytes_per_step(w: Workload, off: OffloadConfig) -> dict:
    """Bytes this rank moves between host and device per optimizer step (0 on a CPU)."""
    if w.device == "cpu":
        return {"grads_down": 0, "grads_up": 0, "params_up": 0, "param_gathers_up": 0,
                "total": 0}
    n, k = shard_elements(w), w.micro_batches
    e_p, e_g = _element_bytes(w)
    lands = lands_grads(w, off)
    out = {
        # the reduced gradient shard, once per step; every micro-batch's sum when they
        # only land on the device, the partial sums coming back up to be added to
        "grads_down": e_g * n * (k if lands else 1) if off.optimizer else 0,
        "grads_up": e_g * n * (k - 1) if lands else 0,
        # the step's new parameter shard; with param offload it stays in its host home
        "params_up": e_p * n if off.optimizer and not off.param else 0,
        # the shard, uploaded for each gather of its unit
        "param_gathers_up": gathers_per_step(w) * e_p * n if off.param else 0,
    }
    out["total"] = sum(out.values())
    return out


def disk_bytes_per_step(w: Workload, off: OffloadConfig) -> dict:
    """Bytes this rank reads from and writes to its swap files per optimizer step."""
    n, k = shard_elements(w), w.micro_batches
    e_p, e_g = _element_bytes(w)
    nvme = off.optimizer == "nvme"
    opt = 12 * n if nvme else 0  # every tile once in, once out
    sums = k if w.zero_stage >= 2 else 1  # gradient sums sent down per step
    param_nvme = off.param == "nvme"
    out = {"optimizer_read": opt, "optimizer_write": opt,
           # each sum of a unit, written; the earlier ones read back, the last by the step
           "grad_write": e_g * n * sums if nvme else 0,
           "grad_read": e_g * n * sums if nvme else 0,
           # the shard, read for each gather of its unit
           "param_read": gathers_per_step(w) * e_p * n if param_nvme else 0,
           # the step's new parameters
           "param_write": e_p * n if param_nvme else 0}
    out["read"] = out["optimizer_read"] + out["grad_read"] + out["param_read"]
    out["write"] = out["optimizer_write"] + out["grad_write"] + out["param_write"]
    out["total"] = out["read"] + out["write"]
    return out


def tier_bytes(w: Workload, off: OffloadConfig, runtime_bytes: int = 0,
               baseline_bytes: int = HOST_BASELINE_BYTES) -> dict:
    """One rank's device, host and disk bytes under ``off``, with their terms.

    ``runtime_bytes``: the device's share of the process (a CUDA context, NCCL;
    0 on a CPU); ``baseline_bytes``: the process in host memory. On a CPU device
    ``host_bytes`` is the whole process: the device's terms and the host's.
    """
    dev = device_terms(w, off, runtime_bytes)
    host, disk = host_terms(w, off, baseline_bytes), disk_terms(w, off)
    device_total, host_total = sum(dev.values()), sum(host.values())
    if w.device == "cpu":
        host_total += device_total
    return {"optimizer": off.optimizer, "param": off.param, "zero_stage": w.zero_stage,
            "setting": setting_name(off.optimizer, off.param),
            "device_bytes": device_total, "host_bytes": host_total,
            "disk_bytes": sum(disk.values()),
            "terms": {"device": dev, "host": host, "disk": disk},
            "pcie_bytes_per_step": pcie_bytes_per_step(w, off),
            "disk_bytes_per_step": disk_bytes_per_step(w, off)}


@dataclass(frozen=True)
class Capacity:
    """What a setting must fit: device bytes per rank, host and disk bytes per node
    shared by ``ranks_per_node`` ranks. None: not checked."""

    device_bytes: float | None = None
    host_bytes: float | None = None
    nvme_bytes: float | None = None
    ranks_per_node: int = 1


def shortfalls(est: dict, cap: Capacity) -> list[dict]:
    """Each capacity ``est`` (a :func:`tier_bytes`) exceeds: its name, what the node's
    ranks need, what there is, and by how many bytes it is short."""
    r = cap.ranks_per_node
    checks = (("device", est["device_bytes"], cap.device_bytes),
              ("host", est["host_bytes"] * r, cap.host_bytes),
              ("nvme", est["disk_bytes"] * r, cap.nvme_bytes))
    return [{"capacity": name, "need_bytes": int(need), "have_bytes": int(have),
             "short_by_bytes": int(need - have)}
            for name, need, have in checks if have is not None and need > have]


def largest_fitting(fits, limit: int = 1 << 12) -> int:
    """The largest ``n`` in ``[1, limit]`` with ``fits(n)``, for a ``fits`` that holds up
    to some size and not beyond (0: not even 1). O(log n) calls."""
    lo, hi = 0, 1  # fits(lo) or lo == 0; not fits(hi), once found
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def rung_workload(w: Workload, optimizer: str | None, param: str | None) -> Workload:
    """``w`` at the stage a setting runs at: stage 3 with param offload, at least 1
    with the optimizer offloaded, else the run's own."""
    if param:
        return w.with_stage(3)
    return w.with_stage(max(w.zero_stage, 1)) if optimizer else w


def offload_ladder(w: Workload, off: OffloadConfig, cap: Capacity, runtime_bytes: int = 0,
                   baseline_bytes: int = HOST_BASELINE_BYTES) -> list[dict]:
    """:func:`tier_bytes` of every :data:`LADDER` setting (``off``'s staging sizes), with
    ``fits`` and, where it does not, ``short``: the capacities it exceeds."""
    rungs = []
    for optimizer, param in LADDER:
        rung = replace(off, optimizer=optimizer, param=param)
        est = tier_bytes(rung_workload(w, optimizer, param), rung, runtime_bytes,
                         baseline_bytes)
        est["short"] = shortfalls(est, cap)
        est["fits"] = not est["short"]
        rungs.append(est)
    return rungs


def recommend_offload(rungs: list[dict]) -> dict | None:
    """The first (cheapest) rung of :func:`offload_ladder` that fits, or None."""
    return next((r for r in rungs if r["fits"]), None)
