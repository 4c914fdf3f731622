"""A simulation as people and programs read it: the step x rank grid, the summary, JSON.

The grid has one row per rank and one column per time quantum (the largest time
that divides every start and end of the step), so an action of two quanta spans two
cells: its label, then ``-``. Labels are the action's code and micro-batch (``F3``:
forward of micro-batch 3), with a letter for the rank's chunk when v > 1 (``F3b``:
its second chunk, stage r + p); ``.`` is idle. Messages take no cell: a wait for
one shows as idle. Torch-free.
"""

from __future__ import annotations

import math
from fractions import Fraction

from hybrid.pipeline.actions import COMPUTE, Action, stage_chunk
from hybrid.pipeline.simulator import Simulation, Value

LEGEND = ("F forward, B backward, I its input-gradient half, W its weight-gradient half; "
          "the number is the micro-batch")


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def _text(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):g}"


def _figures(x: Value) -> str:
    """A time of every stage, or one per stage: ``1.5`` or ``1 2`` (stage 0 first)."""
    return _text(x) if isinstance(x, Fraction) else " ".join(_text(y) for y in x)


def _numbers(x: Value) -> int | float | list[int | float]:
    return _number(x) if isinstance(x, Fraction) else [_number(y) for y in x]


def _quantum(sim: Simulation) -> Fraction:
    """The largest time dividing every start and end in the step."""
    points = {t for slots in sim.timelines for s in slots for t in (s.start, s.end) if t}
    if not points:
        return Fraction(1)
    denominator = math.lcm(*(t.denominator for t in points))
    return Fraction(math.gcd(*(int(t * denominator) for t in points)), denominator)


def _label(action: Action, sim: Simulation) -> str:
    label = f"{action.kind.value}{action.microbatch}"
    if sim.schedule.v > 1:
        label += "abcdefghijklmnopqrstuvwxyz"[stage_chunk(action.stage, sim.schedule.p) % 26]
    return label


def grid_lines(sim: Simulation, max_columns: int = 600) -> list[str]:
    """The step x rank grid, one line per rank below a time ruler (a note instead, when
    it would take more than ``max_columns`` cells)."""
    q = _quantum(sim)
    columns = int(sim.step_time / q)
    if columns > max_columns:
        return [f"(no grid: {columns} cells of {_text(q)} per rank, more than {max_columns})"]
    computes = [[s for s in slots if s.action.kind in COMPUTE] for slots in sim.timelines]
    width = 1 + max((len(_label(s.action, sim)) for row in computes for s in row), default=2)
    head = len(f"rank {sim.schedule.p - 1} ")
    ruler = "".join(f"{_text(c * q):<{width * 5}}" for c in range(0, columns, 5))
    lines = ["time".ljust(head) + "|" + ruler.rstrip()]
    for rank, row in enumerate(computes):
        cells = [".".ljust(width)] * columns
        for slot in row:
            first, span = int(slot.start / q), int((slot.end - slot.start) / q)
            text = _label(slot.action, sim).ljust(span * width - 1, "-") + " "
            for k in range(span):
                cells[first + k] = text[k * width:(k + 1) * width]
        lines.append(f"rank {rank}".ljust(head) + "|" + "".join(cells).rstrip())
    return lines


def report(sim: Simulation) -> str:
    """The grid with a header (sizes, times, legend) and the bubble and peaks below it."""
    s, t = sim.schedule, sim.times
    lines = [
        f"{s.name}: p={s.p} ranks, m={s.m} micro-batches, v={s.v} stage(s) per rank; times"
        + ("" if t.stages is None else " (per stage, stage 0 first)") + ": "
        f"forward {_figures(t.forward)}, input gradient {_figures(t.backward_input)}, weight "
        f"gradient {_figures(t.backward_weight)}, message {_text(t.comm)}",
        f"one cell = {_text(_quantum(sim))}; {LEGEND}"
        + ("; a, b, ... the rank's chunk (stage r, r+p, ...)" if s.v > 1 else "") + "; . idle",
        *grid_lines(sim),
        f"step time {_text(sim.step_time)}; idle per rank "
        f"{' '.join(_text(x) for x in sim.idle)}; bubble {sim.bubble} = "
        f"{float(sim.bubble):.4f} of the step",
        ("peak micro-batches held per rank: " if s.v == 1 else
         f"peak (stage, micro-batch) activations held per rank, each 1/{s.v} of the "
         f"rank's layers: ") + " ".join(str(n) for n in sim.peak_held),
    ]
    return "\n".join(lines)


def summary(sim: Simulation) -> dict:
    """The simulation as a JSON-ready record: sizes, times (a list, stage 0 first, where
    they are given per stage), step time, idle, bubble (a float, and ``bubble_exact`` as
    a fraction), peaks per rank and per stage, each rank's action list in text form and
    the grid's lines."""
    s, t = sim.schedule, sim.times
    return {
        "schedule": s.name, "p": s.p, "m": s.m, "v": s.v,
        "times": {"forward": _numbers(t.forward), "backward_input": _numbers(t.backward_input),
                  "backward_weight": _numbers(t.backward_weight), "comm": _number(t.comm)},
        "step_time": _number(sim.step_time),
        "busy": [_number(x) for x in sim.busy],
        "idle": [_number(x) for x in sim.idle],
        "bubble": float(sim.bubble),
        "bubble_exact": str(sim.bubble),
        "peak_held": list(sim.peak_held),
        "peak_held_per_stage": list(sim.peak_held_per_stage),
        "actions": s.text(),
        "grid": grid_lines(sim),
    }
