#!/usr/bin/env python
"""Peak memory and DP traffic per rank of a pretrain_gpt.py run, for every ZeRO stage,
and where its model states can live: device, host memory, disk.

    python scripts/estimate_memory.py --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 1024 --tensor-model-parallel-size 4 \
        --micro-batch-size 4 --global-batch-size 512 --bf16 --tokenizer-type gpt2bpe \
        --world-size 32 --gpu-memory-gb 80

Takes pretrain_gpt.py's own flags (so a launch script's line can be pasted as
it is, ``--offload-*`` included) plus the few below. Prints one JSON line per
ZeRO stage: model states (params, grads, optimizer), activations for the
recompute mode in use, ZeRO's gather and staging buffers, the predicted peak
per rank (:func:`hybrid.estimate.memory.peak_memory`, no offload) and the
bytes each rank sends per optimizer step with the run's micro-batches per step.
With ``--context-parallel-size C`` (> 1) activations are those of this rank's
``seq_length / C`` tokens, ZeRO shards over DP x CP, and each stage's record
also names ``cp``, ``cp_comm_type``, ``cp_layout`` and ``seq_per_rank``, and its
``traffic_bytes_per_step`` carries ``cp_bytes_per_step``: the bytes each rank
sends over the CP group per step (the attention's K/V exchange, forward and
backward, and the loss's all-reduce; :mod:`hybrid.estimate.context_parallel`).
With ``--pipeline-model-parallel-size P`` (> 1; the stage split by the same flags as a
run: ``--decoder-first-pipeline-num-layers``, ``--pipeline-model-parallel-layout``, ...)
the figures are one rank's of the stage with the highest predicted peak at the run's ZeRO
stage, and each record also names ``pp``, ``vpp``, ``stage``, ``layers_per_stage`` and
``params_per_stage``; activations are those of the micro-batches the schedule keeps in
flight on that stage. One more line (``"pipeline"``) gives every stage's figures at the
run's ZeRO stage (layers, parameters, micro-batches held at its peak, activations, model
states, peak), the p2p bytes each pipeline rank sends a step and the predicted bubble
twice (:mod:`hybrid.estimate.pipeline`): with equal stages (``bubble``, the textbook
figure) and with each virtual stage's times in proportion to its FLOPs per token
(``bubble_flop_weighted``: the embedding on the first, the head and loss on the last,
the split's layers; ``relative_flops`` per virtual stage, over the mean).

Then one line (``"offload"``) for the run's own offload setting at its stage
(:func:`hybrid.estimate.tiers.tier_bytes`): device, host and disk bytes per
rank with their terms, and the bytes each step moves over PCIe and to and from
disk. With ``--host-memory-gb`` or ``--nvme-gb`` (or ``--gpu-memory-gb``) one
line per setting of the offload ladder (none, optimizer cpu, optimizer cpu +
param cpu, optimizer nvme + param cpu, optimizer nvme + param nvme), each with
``fits`` and what is short by how many bytes, and ``recommended_offload``: the
first that fits (null when none does). With ``--gpu-memory-gb`` the last line
names the stage with the least traffic whose peak fits
(``recommended_zero_stage``; null when none does). ``--format text`` prints
the same as a report for people.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from hybrid.config import Flags, build_config
from hybrid.config.flags import build_parser
from hybrid.config.sections import tokenizer_kind
from hybrid.errors import ConfigError
from hybrid.estimate import pipeline as pp_terms
from hybrid.estimate.memory import (
    activation_bytes,
    buffer_bytes,
    choose_stage,
    peak_memory,
    traffic_bytes,
    workload,
)
from hybrid.estimate.model_states import model_state_bytes
from hybrid.estimate.tiers import (
    HOST_BASELINE_BYTES,
    Capacity,
    offload_ladder,
    recommend_offload,
    tier_bytes,
)

GIB = 2 ** 30
OWN = ("world_size", "data_parallel_size", "micro_batches", "gpu_memory_gb", "runtime_gb",
       "device", "host_memory_gb", "nvme_gb", "ranks_per_node", "format")
# Memory a process holds before the model: on the CPU, what benchmarks/bench_memory.py
# measures (memory_before_model_bytes, about 0.25 GB: interpreter, torch, gloo,
# data); on CUDA a reserve for the context, NCCL's buffers and the caching
# allocator's slack that this repository has not measured -- set --runtime-gb.
RUNTIME_GB = {"cpu": 0.25, "cuda": 1.5}
GPUS_PER_NODE = 8  # --ranks-per-node's default on cuda (at most the world size)
NVME_PATH = "(estimate: no file is made)"  # what --offload-* nvme needs to validate


def _parser():
    ap = build_parser()
    ap.prog = "estimate_memory.py"
    ap.usage = ("%(prog)s [pretrain_gpt.py flags] [--world-size N] [--micro-batches K] "
                "[--gpu-memory-gb M] [--host-memory-gb H] [--nvme-gb D] [--ranks-per-node R] "
                "[--runtime-gb R] [--device cuda|cpu] [--format json|text]")
    ap.description = __doc__.split("\n\n")[0]
    g = ap.add_argument_group("the estimate")
    g.add_argument("--world-size", type=int, default=None,
                   help="ranks in the job (default: TP x CP x PP x --data-parallel-size)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="DP size when --world-size is not given")
    g.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step (default: from --global-batch-size)")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="device memory per rank (GiB): recommend the stage that fits")
    g.add_argument("--host-memory-gb", type=float, default=None,
                   help="host memory of a node (GiB), shared by its --ranks-per-node ranks: "
                        "recommend the cheapest offload setting that fits")
    g.add_argument("--nvme-gb", type=float, default=None,
                   help="free space under --offload-nvme-path on a node (GiB), shared by its "
                        "ranks")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks sharing a node's host memory and disk (default: the world size "
                        f"on cpu, at most {GPUS_PER_NODE} on cuda)")
    g.add_argument("--runtime-gb", type=float, default=None,
                   help="memory per rank before the model (GiB; default 0.25 on cpu, 1.5 "
                        "on cuda; on cpu the offload estimate's default is the measured "
                        "import of torch, 221 MiB)")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    g.add_argument("--format", choices=("json", "text"), default="json",
                   help="JSON lines (default) or a report for people")
    return ap


def _config(ap, ns: dict, own: dict):
    """(TrainConfig, vocabulary size) of the command line; exits 2 on a bad layout."""
    # Shapes are all an estimate needs: no tokenizer, data or swap files are read.
    nvme = "nvme" in (ns["offload_optimizer"], ns["offload_param"])
    path = ns["offload_nvme_path"] or (NVME_PATH if nvme else None)
    flags = dataclasses.replace(Flags(**ns), tokenizer_type="byte", data_path=None,
                                offload_nvme_path=path)
    model_parallel = (flags.tensor_model_parallel_size * flags.context_parallel_size
                      * flags.pipeline_model_parallel_size)
    world = own["world_size"] or model_parallel * own["data_parallel_size"]
    if own["micro_batches"] is not None:
        if own["micro_batches"] < 1:
            ap.error("--micro-batches must be >= 1")
        flags.global_batch_size = (own["micro_batches"] * flags.micro_batch_size
                                   * (world // model_parallel))
    try:
        cfg = build_config(flags, world, plan_only=True)  # (plans PP, which cannot run yet)
    except ConfigError as e:
        ap.error(str(e))
    # --vocab-size N: NullTokenizer's ids (N + 1 with its eod); else taken as the vocabulary
    kind = tokenizer_kind(ns["tokenizer_type"] or ("GPT2BPETokenizer" if ns["vocab_file"]
                                                   else "byte"))
    vocab = (ns["vocab_size"] + (kind == "NullTokenizer")
             if ns["vocab_size"] else 257 if kind == "byte" else 50257)
    return cfg, vocab


def _stage_records(w, runtime: int, budget: float | None, vpp: int = 1) -> list[dict]:
    """One record per ZeRO stage (no offload)."""
    records = []
    for stage in range(4):
        ws = w.with_stage(stage)
        peak = peak_memory(ws, runtime)
        record = {
            "zero_stage": stage, "selected": stage == w.zero_stage, "tp": w.tp, "dp": w.dp,
            "micro_batches": w.micro_batches, "params_dtype": w.params_dtype,
            "grads_dtype": w.grads_dtype or w.params_dtype, "recompute": w.recompute,
            "params_per_tp_rank": w.psi,
            "model_states": model_state_bytes(w.psi, w.shard_ranks, stage, w.params_dtype,
                                              w.grads_dtype),
            "activations": activation_bytes(ws), "buffers": buffer_bytes(ws),
            "runtime_bytes": runtime, "peak_bytes": peak["total"],
            "peak_gib": round(peak["total"] / GIB, 3),
            "traffic_bytes_per_step": traffic_bytes(ws)}
        if w.cp > 1:  # (CP 1's records stay as they were)
            record.update(cp=w.cp, cp_comm_type=w.cp_comm_type, cp_layout=w.cp_layout,
                          seq_per_rank=w.seq_per_rank)
        if w.pp > 1:  # (and PP 1's)
            record.update(pp=w.pp, vpp=vpp, stage=w.stage,
                          layers_per_stage=list(w.stage_layers or ()),
                          params_per_stage=[w.stage_psi(s) for s in range(w.pp)])
        if budget is not None:
            record["fits"] = peak["total"] <= budget
        records.append(record)
    return records


def _peak_stage(w, runtime: int):
    """``w`` on the pipeline stage whose predicted peak is the highest at the run's ZeRO
    stage (the first of equals): its parameters and the activations its schedule keeps
    in flight together."""
    if w.pp == 1:
        return w
    return max((dataclasses.replace(w, stage=s) for s in range(w.pp)),
               key=lambda ws: (peak_memory(ws, runtime)["total"], -ws.stage))


def _pipeline_record(w, runtime: int) -> dict:
    """``{"pipeline": ...}``: the schedule's predicted bubble with equal times and with
    times in proportion to each virtual stage's FLOPs (and those FLOPs over the mean
    virtual stage's, model order), the p2p bytes each pipeline rank sends a step, and
    per stage at the run's ZeRO stage: its layers and parameters, the micro-batches it
    holds at its peak, its activations, model states, buffers and predicted peak
    (:mod:`hybrid.estimate.pipeline`)."""
    sim = pp_terms.simulation(w)
    stages = []
    for s in range(w.pp):
        ws = dataclasses.replace(w, stage=s)
        acts = activation_bytes(ws)
        stages.append({
            "stage": s, "layers": list(ws.stage_chunks(s)), "params_per_tp_rank": ws.psi,
            "micro_batches_held": acts["held"], "activations": acts,
            "model_states": model_state_bytes(ws.psi, ws.shard_ranks, ws.zero_stage,
                                              ws.params_dtype, ws.grads_dtype),
            "buffers": buffer_bytes(ws), "peak_bytes": peak_memory(ws, runtime)["total"]})
    bubble, weighted = pp_terms.bubble(w), pp_terms.weighted_bubble(w)
    return {"pipeline": {
        "schedule": sim.schedule.name, "pp": w.pp, "vpp": w.vpp,
        "micro_batches": w.micro_batches, "zero_stage": w.zero_stage,
        "bubble": float(bubble), "bubble_fraction": str(bubble),
        "bubble_flop_weighted": float(weighted),
        "bubble_flop_weighted_fraction": str(weighted),
        "relative_flops": [round(float(x), 4) for x in pp_terms.relative_flops(w)],
        "p2p_bytes_per_step": pp_terms.p2p_bytes_per_step(w), "stages": stages,
        "rule": "activations: each stage's micro-batches in flight at its peak under the "
                "schedule (the simulator's lists); bubble: the simulator with equal "
                "forward, input- and weight-gradient times; bubble_flop_weighted: with "
                "each virtual stage's times in proportion to its FLOPs per token (layers, "
                "head; relative_flops: over the mean virtual stage's, model order); p2p: "
                "sent by each rank"}}


def _offload_records(w, off, own: dict, world: int, runtime: int) -> list[dict]:
    """The run's own setting; with a capacity given, the ladder and its recommendation."""
    cpu = own["device"] == "cpu"
    # on a CPU the process before the model is host memory, not the device's
    device_runtime = 0 if cpu else runtime
    baseline = runtime if cpu and own["runtime_gb"] is not None else HOST_BASELINE_BYTES
    records: list[dict[str, Any]] = [{"offload": tier_bytes(w, off, device_runtime, baseline)}]
    gib = {k: None if own[k] is None else own[k] * GIB
           for k in ("gpu_memory_gb", "host_memory_gb", "nvme_gb")}
    if all(v is None for v in gib.values()):
        return records
    per_node = own["ranks_per_node"] or (world if cpu else min(world, GPUS_PER_NODE))
    cap = Capacity(gib["gpu_memory_gb"], gib["host_memory_gb"], gib["nvme_gb"], per_node)
    rungs = offload_ladder(w, off, cap, device_runtime, baseline)
    records += [{"offload_rung": i, **r} for i, r in enumerate(rungs)]
    best = recommend_offload(rungs)
    records.append({
        "recommended_offload": None if best is None else best["setting"],
        "optimizer": None if best is None else best["optimizer"],
        "param": None if best is None else best["param"],
        "zero_stage": None if best is None else best["zero_stage"],
        "ranks_per_node": per_node, **{k: own[k] for k in gib},
        "why_not": {r["setting"]: r["short"] for r in rungs[:rungs.index(best)
                                                             if best else len(rungs)]},
        "rule": "the first setting of the ladder (none, optimizer cpu, optimizer cpu + param "
                "cpu, optimizer nvme + param cpu, optimizer nvme + param nvme) whose device "
                "bytes per rank and host and disk bytes per node fit"})
    return records


def main(argv=None) -> int:
    ap = _parser()
    ns = vars(ap.parse_args(argv))
    own = {k: ns.pop(k) for k in OWN}
    if own["ranks_per_node"] is not None and own["ranks_per_node"] < 1:
        ap.error("--ranks-per-node must be >= 1")
    cfg, vocab = _config(ap, ns, own)
    runtime = int((own["runtime_gb"] if own["runtime_gb"] is not None
                   else RUNTIME_GB[own["device"]]) * GIB)
    w = _peak_stage(workload(cfg, vocab, own["device"]), runtime)  # (PP 1: the one stage)
    budget = own["gpu_memory_gb"] * GIB if own["gpu_memory_gb"] is not None else None
    records = _stage_records(w, runtime, budget, cfg.pipeline.virtual_size)
    if w.pp > 1:
        records.append(_pipeline_record(w, runtime))
    records += _offload_records(w, cfg.offload, own, cfg.parallel.world_size, runtime)
    if budget is not None:
        records.append({"recommended_zero_stage": choose_stage(w, budget, runtime),
                        "gpu_memory_gb": own["gpu_memory_gb"],
                        "rule": "least DP traffic per step among the stages whose "
                                "predicted peak fits"})
    if own["format"] == "text":
        print(_text(records))
    else:
        for record in records:
            print(json.dumps(record))
    return 0


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB ({int(nbytes):,} B)"


def _short(short: list[dict]) -> str:
    return "; ".join(f"{s['capacity']} short by {s['short_by_bytes']:,} B (needs "
                     f"{_size(s['need_bytes'])}, has {_size(s['have_bytes'])})" for s in short)


def _text_offload(est: dict, indent: str = "  ") -> list[str]:
    pcie, disk = est["pcie_bytes_per_step"], est["disk_bytes_per_step"]
    return [f"{indent}device {_size(est['device_bytes'])}",
            f"{indent}host   {_size(est['host_bytes'])}",
            f"{indent}disk   {_size(est['disk_bytes'])}",
            f"{indent}per step: PCIe {_size(pcie['total'])} (grads down {pcie['grads_down']:,} "
            f"B, up {pcie['grads_up']:,} B, params up {pcie['params_up']:,} B, gathers up "
            f"{pcie['param_gathers_up']:,} B); disk read {_size(disk['read'])}, "
            f"write {_size(disk['write'])}"]


def _text(records: list[dict]) -> str:
    """The records as a report for people."""
    stages = [r for r in records if "selected" in r]
    s = stages[0]
    lines = [f"{s['params_per_tp_rank']:,} parameters per TP rank; TP {s['tp']}, DP {s['dp']}, "
             f"micro-batches per step {s['micro_batches']}, {s['params_dtype']} params, "
             f"{s['grads_dtype']} grads", "ZeRO stages, no offload (peak per rank, DP bytes "
             "sent per step):"]
    if "pp" in s:
        lines.insert(1, f"PP {s['pp']} (virtual {s['vpp']}): layers per stage "
                        f"{s['layers_per_stage']}, parameters per TP rank "
                        f"{s['params_per_stage']}; the figures are stage {s['stage']}'s")
    if "cp" in s:
        cp_bytes = s["traffic_bytes_per_step"]["cp_bytes_per_step"]["total"]
        lines.insert(1, f"CP {s['cp']} ({s['cp_comm_type']}, {s['cp_layout']}): "
                        f"{s['seq_per_rank']:,} tokens of each sequence per rank; sends "
                        f"{_size(cp_bytes)} per step over CP (K/V exchange and loss)")
    for r in stages:
        fits = "" if "fits" not in r else ("  fits" if r["fits"] else "  does not fit")
        lines.append(f"  stage {r['zero_stage']}{'*' if r['selected'] else ' '} "
                     f"{_size(r['peak_bytes'])}, sends "
                     f"{_size(r['traffic_bytes_per_step']['total'])}{fits}")
    for r in records:
        if "pipeline" in r:
            pl = r["pipeline"]
            lines.append(f"pipeline: {pl['schedule']}, {pl['micro_batches']} micro-batches; "
                         f"predicted bubble {pl['bubble_fraction']} = {pl['bubble']:.4f} "
                         f"(equal stages), {pl['bubble_flop_weighted']:.4f} (stages weighted "
                         f"by their FLOPs: "
                         f"{', '.join(f'{x:.2f}' for x in pl['relative_flops'])} of the "
                         f"mean); p2p "
                         f"{_size(pl['p2p_bytes_per_step']['total'])} per step "
                         f"(per rank {pl['p2p_bytes_per_step']['ranks']})")
            lines += [f"  pipeline stage {x['stage']}: {sum(x['layers'])} layers, "
                      f"{x['params_per_tp_rank']:,} parameters, {x['micro_batches_held']} "
                      f"micro-batches held, activations {_size(x['activations']['peak'])}, "
                      f"peak {_size(x['peak_bytes'])} at ZeRO-{pl['zero_stage']}"
                      for x in pl["stages"]]
    for r in records:
        if "offload" in r:
            est = r["offload"]
            lines.append(f"this run's offload: {est['setting']} at ZeRO-{est['zero_stage']}, "
                         "per rank:")
            lines += _text_offload(est)
        elif "offload_rung" in r:
            verdict = "fits" if r["fits"] else "does not fit: " + _short(r["short"])
            lines.append(f"ladder {r['offload_rung'] + 1}: {r['setting']} (ZeRO-"
                         f"{r['zero_stage']}): {verdict}")
            lines += _text_offload(r, "    ")
        elif "recommended_offload" in r:
            best = r["recommended_offload"]
            last = list(r["why_not"].values())[-1] if r["why_not"] else []
            lines.append(f"recommended offload: {best} (ZeRO-{r['zero_stage']}; "
                         f"{r['ranks_per_node']} ranks per node)" if best else
                         f"recommended offload: none fits; even the last: {_short(last)}")
        elif "recommended_zero_stage" in r:
            stage = r["recommended_zero_stage"]
            lines.append("recommended ZeRO stage (no offload): "
                         + ("none fits" if stage is None else str(stage)))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
