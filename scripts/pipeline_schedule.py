#!/usr/bin/env python
"""A pipeline schedule, simulated: its step x rank grid, bubble and peak activations.

    python scripts/pipeline_schedule.py --schedule 1f1b -p 4 -m 8
    python scripts/pipeline_schedule.py --schedule interleaved_1f1b -p 4 -m 8 -v 2
    python scripts/pipeline_schedule.py --schedule zb_h1 -p 4 -m 8 --times 1,1,1 --json

``--schedule`` takes ``--pipeline-schedule``'s names (gpipe, 1f1b, interleaved_1f1b,
zb_h1; 1f1b with -v above 1 is interleaved, as in training). ``--times f,b,w``: the
forward, input-gradient and weight-gradient time of one micro-batch on one stage (a
whole backward is b + w; default 1,1,1); ``--comm``: a message's time. Prints the
report of :func:`hybrid.pipeline.report.report`, or with ``--json`` one JSON object
(:func:`hybrid.pipeline.report.summary`); ``--actions`` adds each rank's list.
A combination the schedule cannot run exits 2 with the error naming the flags. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybrid.errors import ConfigError
from hybrid.pipeline.report import report, summary
from hybrid.pipeline.schedules import SCHEDULES, build_schedule
from hybrid.pipeline.simulator import Times, simulate


def _times(text: str) -> tuple[str, str, str]:
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"--times {text}: three numbers f,b,w")
    return parts[0], parts[1], parts[2]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="1f1b", help=", ".join(SCHEDULES))
    ap.add_argument("-p", "--pipeline-model-parallel-size", type=int, default=4, dest="p")
    ap.add_argument("-m", "--microbatches", type=int, default=8, dest="m",
                    help="micro-batches per step")
    ap.add_argument("-v", "--virtual-pipeline-model-parallel-size", type=int, default=1,
                    dest="v")
    ap.add_argument("--times", type=_times, default=("1", "1", "1"),
                    help="forward,input-gradient,weight-gradient time (default 1,1,1)")
    ap.add_argument("--comm", default="0", help="a message's time (default 0)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    ap.add_argument("--actions", action="store_true", help="also print each rank's list")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        schedule = build_schedule(args.schedule, args.p, args.m, args.v)
        forward, backward_input, backward_weight = args.times
        times = Times(forward, backward_input, backward_weight, comm=args.comm)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sim = simulate(schedule, times)
    if args.json:
        print(json.dumps(summary(sim)))
        return 0
    print(report(sim))
    if args.actions:
        for rank, line in enumerate(schedule.text()):
            print(f"rank {rank}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
