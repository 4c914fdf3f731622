"""The slowest and the fastest rank of a log interval, and how much slower.

Collectives make every rank wait for the slowest, so wall-clock step times are
nearly equal everywhere; what differs is the *busy* time, the step time
minus the time a rank spent blocked in collectives (``CommStats.wait_s``). The
straggler is the rank with the most busy time -- the one the others waited
for. Both are gathered once per log interval (one all-gather of two float64
per rank over the world), never per step.

On CUDA with NCCL a collective returns once enqueued, so the host-side wait is
near zero there and busy time equals step time; the wall-clock pair is then
the signal (a rank whose host is slow still starts its steps late).
"""

from __future__ import annotations

import torch


def straggler_fields(ps, step_time_s: float, busy_time_s: float) -> dict:
    """``step_time_{max,min}_{s,rank}`` and ``busy_time_{max,min}_{s,rank}`` over all
    ranks (this rank's mean step and busy time of the interval as input).
    Collective over the world group."""
    mine = torch.tensor([step_time_s, busy_time_s], dtype=torch.float64, device=ps.device)
    every = torch.empty(2 * ps.world_size, dtype=torch.float64, device=ps.device)
    ps.world_group.all_gather(every, mine)
    per_rank = every.view(ps.world_size, 2).cpu()
    out = {}
    for col, name in enumerate(("step_time", "busy_time")):
        v = per_rank[:, col]
        hi, lo = int(v.argmax()), int(v.argmin())
        out.update({f"{name}_max_s": float(v[hi]), f"{name}_max_rank": hi,
                    f"{name}_min_s": float(v[lo]), f"{name}_min_rank": lo})
    return out
