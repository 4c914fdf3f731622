"""Which units a host step has finished after each of its chunks, in either order.

The host step (:mod:`hybrid.zero.offload.host_step`) updates the flat shard a chunk at a
time: a unit per chunk on the cpu tier, a tile that may straddle units on the
nvme tier. After each chunk the step lets go of the units it has finished: their
host gradient buffers may be rewritten, their new parameters may go up.

[Note: the delayed update runs last to first]
The update in flight during a step's backward must have read a unit's host
gradient before that unit's new one comes down, and backward sends the last
unit first. Run forward, backward would wait at its first unit for the whole
update; run last to first, it waits (if at all) only for the units the update
has not reached yet. Every element's update is independent of the others', so
the order changes no bit. Steps that are not delayed keep the forward order:
their uploads (and, at stages 1-2, all-gathers) go out in it while the worker
goes on.
"""

from __future__ import annotations

import bisect


def reverse_ends(chunks: list[tuple[int, int]], bounds: list[int]) -> list[list[int]]:
    """Per chunk, when the chunks run last to first: the units whose every element is
    updated once it is (those that start in it; an empty one, at its start)."""
    out, todo = [], len(bounds) - 2
    for lo, _ in reversed(chunks):
        ends = []
        while todo >= 0 and bounds[todo] >= lo:
            ends.append(todo)
            todo -= 1
        out.append(ends)
    return out[::-1]


def chunk_units(chunks: list[tuple[int, int]], bounds: list[int]):
    """Per chunk ``[lo, hi)`` of the flat shard: (the units it overlaps, the units
    whose last element it holds). ``bounds[i]``: where unit ``i`` starts."""
    out, done = [], 0
    for lo, hi in chunks:
        first = max(0, bisect.bisect_right(bounds, lo) - 1)
        touches = []
        for i in range(first, len(bounds) - 1):
            if bounds[i] >= hi:
                break
            if bounds[i + 1] > lo:
                touches.append(i)
        ends = []
        while done < len(bounds) - 1 and bounds[done + 1] <= hi:
            ends.append(done)
            done += 1
        out.append((touches, ends))
    return out
