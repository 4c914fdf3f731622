#!/usr/bin/env python
"""Each pipeline schedule at PP 2 on this machine, against what the simulator predicts.

    python -m benchmarks.bench_pipeline [--layers 8] [--hidden 256] [--m 8] [--steps 8]

A GPT (untied head, no dropout) cut into even stages runs on two gloo ranks
(:func:`hybrid.testing.pool.run_ranks` with ``pp=2``) through the executor
(:func:`hybrid.pipeline.executor.run_actions`, plain autograd, no ZeRO: the executor
runs interleaving only so), one stage per rank for ``gpipe``, ``1f1b`` and ``zb_h1``
and two (``v = 2``, four stages) for ``interleaved_1f1b``. The schedules take turns
step by step, in ABBA order (the order reversed every other round), so the
machine's drift hits them alike. A step is the forward and backward of the step's
``m`` micro-batches (no optimizer), timed between barriers: its time is the last
rank's. Every record after the first line (the machine, torch, the shape) is one
schedule's:

* ``step_s``: the median step after ``--warmup`` steps;
* per stage, the median seconds of one micro-batch's forward and backward (or its
  input and weight halves), from the executor's timeline (``timeline=``);
* per rank, the measured idle fraction (the step less this rank's compute, over the
  step: receives waited and END) beside the simulator's prediction
  (:func:`hybrid.pipeline.simulator.simulate`) from ``Times`` made of each stage's
  own measured per-micro-batch times (``comm`` 0; a whole backward counts as two
  equal halves), ``idle_fraction_predicted``, and, as ``..._uniform``, from those
  times averaged over the stages (every stage equal, the prediction before the
  simulator took a figure per stage). ``predicted_step_s`` is the per-stage
  prediction's step time in seconds, ``times_for_simulator_s`` its times (stage 0
  first); ``stage_imbalance`` the slowest stage's compute per micro-batch over the
  fastest's, which the uniform prediction takes as 1;
* per rank and per stage, the micro-batches whose activations are held at the peak,
  measured (each forward under its own
  :class:`hybrid.train.activation_meter.SavedActivationMeter`: a micro-batch is held
  while any tensor its forward saved for backward is alive, or, under ZB-H1, from its
  input half until its weight half, whose store keeps the linears' inputs and output
  gradients (not counted in the bytes); sampled after every
  forward, where the count and the bytes can only have grown), the simulator's peak
  and the schedule's formula; the peak bytes saved for backward on each rank and one
  micro-batch's bytes per stage. This step runs apart from the timed ones (the
  meter's hooks cost time);
* per rank, the p2p bytes it sent in a step (the comm door's counters) and the
  formula: each of its stages sends its output to the next stage's rank and the
  gradient of its input to the previous one's, ``B * T * C * bytes`` each, per
  micro-batch; the pipeline's total is ``2 (p v - 1) m B T C bytes``.

The last record sums up: each schedule's step time and its ratio to 1F1B, the
bubbles, the peaks, whether every count and byte figure matched its formula, and
whether every schedule computed the same losses. Nothing is asserted about time:
docs/measurements.md keeps the figures with their machine and date.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from statistics import mean

import torch

from benchmarks.timing import Stopwatch, emit, median_of, world_barrier
from hybrid.pipeline.actions import COMPUTE, RECVS, Kind
from hybrid.pipeline.schedules import build_schedule
from hybrid.pipeline.simulator import Simulation, Times, simulate
from hybrid.pipeline.wire import Activation
from hybrid.testing.pool import run_ranks

P = 2  # the pipeline size this bench runs
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def virtual(name: str) -> int:
    """Stages per rank: 2 for the interleaved schedule, else 1."""
    return 2 if name == "interleaved_1f1b" else 1


def formula_held(name: str, p: int, m: int, v: int, rank: int) -> int:
    """The schedule's peak of (stage, micro-batch) activations on ``rank`` (one stage per
    rank but interleaving): GPipe all m, 1F1B ``p - s``, ZB-H1 p (at most m each),
    interleaved 1F1B ``2 (p - r - 1) + (v - 1) p + 1`` chunks (at most ``v m``)."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - rank, m)
    if name == "zb_h1":
        return min(p, m)
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m)


def p2p_formula(p: int, v: int, m: int, rank: int, message: int) -> int:
    """Bytes ``rank`` sends in a step: an activation from each of its stages but the
    last stage of the model, a gradient from each but the first, per micro-batch."""
    acts = v - (rank == p - 1)
    grads = v - (rank == 0)
    return (acts + grads) * m * message


# -- one rank --------------------------------------------------------------------------
class _Stages:
    """This rank's stages of one schedule's model, its data and its step."""

    def __init__(self, ps, name: str, a):
        from hybrid.config.model import ModelConfig
        from hybrid.parallel.state import ParallelState
        from models.gpt import GPT
        self.ps, self.name, self.a = ps, name, a
        self.v = virtual(name)
        self.schedule = build_schedule(name, P, a.m, self.v)
        n = P * self.v
        if a.layers % n:
            raise SystemExit(f"--layers {a.layers}: must be a multiple of {n} "
                             f"(the stages of {name} at PP {P})")
        per = a.layers // n
        cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden,
                          num_attention_heads=a.heads, seq_length=a.seq,
                          max_position_embeddings=a.seq, hidden_dropout=0.0,
                          attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                          make_vocab_size_divisible_by=1).with_vocab_size(a.vocab)
        tp = ParallelState.single().tp_group
        self.stages = n
        self.models = {s: GPT(cfg, tp, seed=1234, layers=range(s * per, (s + 1) * per),
                              pre_process=s == 0, post_process=s == n - 1,
                              split_backward=name == "zb_h1")
                       for s in range(ps.pp_rank, n, P)}
        self.params = {s: [q for q in model.parameters() if q.requires_grad]
                       for s, model in self.models.items()}
        # ZB-H1's stores: each linear's weight gradient deferred from I to W
        self.weight_grads = {s: model.weight_grads for s, model in self.models.items()
                             if model.weight_grads is not None}
        g = torch.Generator().manual_seed(7)
        data = torch.randint(0, a.vocab, (a.m, a.micro_batch, a.seq + 1), generator=g)
        self.batches = [(d[:, :-1], d[:, 1:]) for d in data]
        self.barrier = world_barrier(ps)
        self.meters: dict | None = None  # (stage, micro-batch) -> its forward's meter
        self.timeline: list | None = None  # the metered step's actions done so far
        self.samples: list = []  # after each metered forward: the held micro-batches

    def forward(self, s: int, j: int, x: Activation | None) -> torch.Tensor:
        if self.meters is None:
            return self._forward(s, j, x)
        from hybrid.train.activation_meter import SavedActivationMeter
        with SavedActivationMeter() as meter:
            out = self._forward(s, j, x)
        self.meters[(s, j)] = meter
        held = {key: m.held() for key, m in self.meters.items()}
        # ZB-H1: after its input half a micro-batch's graph is freed, but its linears'
        # inputs and output gradients wait in the store for the weight half: held too
        done = self.timeline if self.timeline is not None else []
        halves = {(a.stage, a.microbatch) for a, *_ in done if a.kind.value == "I"}
        waiting = halves - {(a.stage, a.microbatch) for a, *_ in done if a.kind.value == "W"}
        self.samples.append(({key for key, b in held.items() if b > 0} | waiting,
                             sum(held.values())))
        return out

    def _forward(self, s: int, j: int, x: Activation | None) -> torch.Tensor:
        tokens, labels = self.batches[j]
        assert x is None or isinstance(x, torch.Tensor)  # (GPT's stages pass one tensor)
        model = self.models[s]
        if x is None:
            return model(tokens)
        if s < self.stages - 1:
            return model(hidden=x)
        return model(hidden=x, labels=labels) / self.a.m

    def step(self, timeline: list | None = None) -> tuple[float, int, dict]:
        """(seconds from the common start to this rank's END, p2p bytes sent, losses)."""
        from hybrid.pipeline.executor import run_actions
        for ps_ in self.params.values():
            for q in ps_:
                q.grad = None
        a, stats = self.a, self.ps.pp_group.stats
        before = stats.bytes["p2p"]
        with Stopwatch(barrier=self.barrier) as sw:
            losses = run_actions(self.schedule.ranks[self.ps.pp_rank], self.forward,
                                 self.params, self.ps.pp_group,
                                 shape=(a.micro_batch, a.seq, a.hidden), dtype=torch.float32,
                                 device=self.ps.device, stages=self.stages,
                                 weight_grads=self.weight_grads, timeline=timeline)
        return sw.seconds, stats.bytes["p2p"] - before, {j: float(x) * a.m
                                                        for j, x in losses.items()}

    def metered_step(self) -> dict:
        """One step with a meter per forward: the peaks of held micro-batches (per rank,
        per stage) and of saved bytes, one micro-batch's bytes per stage, and whether
        everything was freed by the end."""
        self.meters, self.samples, self.timeline = {}, [], []
        self.step(self.timeline)
        meters, samples = self.meters, self.samples
        self.meters = self.timeline = None
        peak_stage = {s: max(sum(1 for (t, _) in held if t == s) for held, _ in samples)
                      for s in self.models}
        return {"peak_held": max(len(held) for held, _ in samples),
                "peak_held_per_stage": peak_stage,
                "peak_bytes": max(b for _, b in samples),
                "bytes_per_microbatch": {s: max(m.peak for (t, _), m in meters.items()
                                                if t == s) for s in self.models},
                "freed": all(m.held() == 0 for m in meters.values())}


def _digest(timeline: list) -> dict:
    """One step's timeline: compute seconds by (kind, stage), the total, the receives'."""
    compute: dict[str, list[float]] = {}
    busy = recv = 0.0
    for action, start, end in timeline:
        if action.kind in COMPUTE:
            compute.setdefault(f"{action.kind.value}{action.stage}", []).append(end - start)
            busy += end - start
        elif action.kind in RECVS:
            recv += end - start
    return {"compute": compute, "busy": busy, "recv": recv}


def _rank(ps, a) -> dict:
    """Every schedule on this rank: timed steps in ABBA order, then a metered step each."""
    torch.set_num_threads(1)
    runs = {name: _Stages(ps, name, a) for name in a.schedules}
    out: dict = {name: {"steps": [], "p2p": [], "losses": None} for name in runs}
    for i in range(a.warmup + a.steps):
        for name in (a.schedules if i % 2 == 0 else a.schedules[::-1]):
            timeline: list = []
            seconds, sent, losses = runs[name].step(timeline)
            if i >= a.warmup:
                out[name]["steps"].append({"seconds": seconds, **_digest(timeline),
                                           "actions": len(timeline)})
                out[name]["p2p"].append(sent)
                out[name]["losses"] = losses
    for name, run in runs.items():
        out[name]["memory"] = run.metered_step()
        out[name]["list_length"] = len(run.schedule.ranks[ps.pp_rank])
    return out


# -- the records -----------------------------------------------------------------------
def _stage_times(results: list[dict], name: str, stages: int) -> dict[int, dict[str, float]]:
    """Per stage: the median seconds of each compute kind it ran, over steps and
    micro-batches."""
    got: dict[int, dict[str, float]] = {}
    for s in range(stages):
        steps = results[s % P][name]["steps"]
        for kind in (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT):
            xs = [t for st in steps for t in st["compute"].get(f"{kind.value}{s}", [])]
            if xs:
                got.setdefault(s, {})[kind.name.lower()] = median_of(xs)
    return got


def _seconds(x: float) -> float:
    """A measured time for the simulator: to the microsecond, and at least one (a stage
    whose input half is empty still gets a positive time)."""
    return max(round(x, 6), 1e-6)


def _halves(t: dict[str, float]) -> tuple[float, float]:
    """One stage's (input, weight) halves: measured under ZB-H1, else a whole backward
    cut in equal halves (only their sum matters to a schedule without ``I``/``W``)."""
    if "backward" in t:
        return t["backward"] / 2, t["backward"] / 2
    return t["backward_input"], t["backward_weight"]


def _times(per_stage: dict[int, dict[str, float]]) -> Times:
    """The simulator's times, each virtual stage its own measured medians."""
    stages = [per_stage[s] for s in sorted(per_stage)]
    return Times([_seconds(t["forward"]) for t in stages],
                 [_seconds(_halves(t)[0]) for t in stages],
                 [_seconds(_halves(t)[1]) for t in stages])


def _uniform_times(per_stage: dict[int, dict[str, float]]) -> Times:
    """The same times averaged over the stages: every stage equal, as the simulator's
    stages were before it took a figure per stage."""
    stages = list(per_stage.values())
    return Times(_seconds(mean(t["forward"] for t in stages)),
                 _seconds(mean(_halves(t)[0] for t in stages)),
                 _seconds(mean(_halves(t)[1] for t in stages)))


def _record(name: str, results: list[dict], a) -> tuple[dict, Simulation]:
    v = virtual(name)
    stages = P * v
    message = a.micro_batch * a.seq * a.hidden * 4  # fp32 activations between stages
    n_steps = len(results[0][name]["steps"])
    step_s = [max(r[name]["steps"][k]["seconds"] for r in results) for k in range(n_steps)]
    per_stage = _stage_times(results, name, stages)
    schedule = build_schedule(name, P, a.m, v)
    sim = simulate(schedule, _times(per_stage))
    uniform = simulate(schedule, _uniform_times(per_stage))
    ranks = []
    for r, res in enumerate(results):
        steps, mem = res[name]["steps"], res[name]["memory"]
        idle = [(step_s[k] - steps[k]["busy"]) / step_s[k] for k in range(n_steps)]
        ranks.append({
            "rank": r, "stages": list(range(r, stages, P)),
            "idle_fraction": round(median_of(idle), 4),
            "idle_fraction_predicted": round(float(sim.idle[r] / sim.step_time), 4),
            "idle_fraction_predicted_uniform": round(float(uniform.idle[r]
                                                           / uniform.step_time), 4),
            "compute_s": round(median_of(st["busy"] for st in steps), 4),
            "recv_wait_s": round(median_of(st["recv"] for st in steps), 4),
            "timeline_actions": steps[-1]["actions"], "list_actions": res[name]["list_length"],
            "peak_held": mem["peak_held"], "peak_held_simulated": sim.peak_held[r],
            "peak_held_formula": formula_held(name, P, a.m, v, r),
            "peak_activation_bytes": mem["peak_bytes"],
            "activations_freed_after_step": mem["freed"],
            "p2p_bytes_per_step": res[name]["p2p"][-1],
            "p2p_bytes_formula": p2p_formula(P, v, a.m, r, message),
            "p2p_bytes_same_every_step": len(set(res[name]["p2p"])) == 1})
    stage_rows = []
    for s in range(stages):
        mem = results[s % P][name]["memory"]
        stage_rows.append({"stage": s, "rank": s % P,
                           **{f"{k}_s": round(t, 5) for k, t in per_stage[s].items()},
                           "activation_bytes_per_microbatch": mem["bytes_per_microbatch"][s],
                           "peak_held": mem["peak_held_per_stage"][s],
                           "peak_held_simulated": sim.peak_held_per_stage[s]})
    per_mb = [sum(t.values()) for t in per_stage.values()]  # one micro-batch's compute
    losses = results[-1][name]["losses"]
    busy = sum(median_of(st["busy"] for st in res[name]["steps"]) for res in results)
    step = median_of(step_s)
    return {"schedule": name, "p": P, "v": v, "m": a.m, "step_s": round(step, 4),
            "predicted_step_s": round(float(sim.step_time), 4),
            "predicted_step_s_uniform": round(float(uniform.step_time), 4),
            "bubble": round(1 - busy / (P * step), 4),
            "bubble_predicted": round(float(sim.bubble), 4),
            "bubble_predicted_uniform": round(float(uniform.bubble), 4),
            "stage_imbalance": round(max(per_mb) / min(per_mb), 3),
            "times_for_simulator_s": {kind: [float(x) for x in getattr(sim.times, kind)]
                                      for kind in ("forward", "backward_input",
                                                   "backward_weight")},
            "stages": stage_rows, "ranks": ranks,
            "p2p_bytes_per_step": sum(r["p2p_bytes_per_step"] for r in ranks),
            "p2p_bytes_formula": 2 * (P * v - 1) * a.m * message,
            "mean_loss": round(mean(losses.values()), 6)}, sim


def _exact(rec: dict) -> bool:
    """Every count and byte figure of a record equals its formula and the simulator."""
    ranks_ok = all(r["peak_held"] == r["peak_held_simulated"] == r["peak_held_formula"]
                   and r["p2p_bytes_per_step"] == r["p2p_bytes_formula"]
                   and r["p2p_bytes_same_every_step"] and r["activations_freed_after_step"]
                   and r["timeline_actions"] == r["list_actions"] for r in rec["ranks"])
    stages_ok = all(s["peak_held"] == s["peak_held_simulated"] for s in rec["stages"])
    return ranks_ok and stages_ok and rec["p2p_bytes_per_step"] == rec["p2p_bytes_formula"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="a multiple of 4 (interleaving)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per step (even)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    emit({"bench": "pipeline", "machine": {
        "python": platform.python_version(), "torch": torch.__version__,
        "cpus": os.cpu_count(), "threads_per_rank": 1, "date": time.strftime("%Y-%m-%d")},
        "shape": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq,
                  "vocab": a.vocab, "micro_batch": a.micro_batch, "m": a.m, "pp": P},
        "warmup": a.warmup, "steps": a.steps, "order": "ABBA by step"})
    results = run_ranks(_rank, world_size=P, pp=P, args=(a,), timeout=3600)
    records = {}
    for name in a.schedules:
        records[name], _ = _record(name, results, a)
        emit(records[name])
    ref = records.get("1f1b")
    losses = [r["mean_loss"] for r in records.values()]
    emit({"summary": {name: {
        "step_s": r["step_s"], "predicted_step_s": r["predicted_step_s"],
        "ratio_to_1f1b": round(r["step_s"] / ref["step_s"], 3) if ref else None,
        "bubble": r["bubble"], "bubble_predicted": r["bubble_predicted"],
        "bubble_predicted_uniform": r["bubble_predicted_uniform"],
        "idle_fraction_per_rank": [x["idle_fraction"] for x in r["ranks"]],
        "idle_fraction_predicted_per_rank": [x["idle_fraction_predicted"] for x in r["ranks"]],
        "peak_held_per_rank": [x["peak_held"] for x in r["ranks"]],
        "peak_activation_bytes_per_rank": [x["peak_activation_bytes"] for x in r["ranks"]],
        "p2p_bytes_per_step": r["p2p_bytes_per_step"], "exact": _exact(r)}
        for name, r in records.items()},
        "all_exact": all(_exact(r) for r in records.values()),
        "loss_spread": round(max(losses) - min(losses), 7)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
