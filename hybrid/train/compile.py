"""``--compile``: torch.compile each transformer block's forward.

Only the block's own ``forward`` is compiled (an instance attribute wrapping
the class's), so module hooks stay eager Python outside the graph: ZeRO's
stage-3 gathers wait on collectives and resize storages, and its gradient
hooks launch reductions -- nothing a graph should capture. Inductor's
``fallback_random`` makes dropout draw eager's random numbers from the
current generator, so the TP RNG tracker's per-region streams give the same
masks compiled or not, and a compiled run follows the eager loss curve to
rounding (``tests/train/test_compile.py``). Whether it is faster was not measured
(no GPU was at hand when this was written): ``scripts/bench_throughput.py
--compile`` measures it.

Activation checkpointing replaces ``block.forward`` itself, so the two are
not combined (``hybrid.config`` refuses it).
"""

from __future__ import annotations

import torch
from torch import nn


def compile_blocks(blocks) -> None:
    """Replace each block's forward with its compiled version (in place)."""
    for block in blocks:
        block: nn.Module
        block.forward = torch.compile(block.forward, options={"fallback_random": True})
