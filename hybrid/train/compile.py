"""``--compile``: torch.compile each transformer block's forward.

Only the block's own ``forward`` is compiled (an instance attribute wrapping
the class's), so module hooks stay eager Python outside the graph: ZeRO's
stage-3 gathers wait on collectives and resize storages, and its gradient
hooks launch reductions -- nothing a graph should capture. Inductor's
``fallback_random`` makes dropout draw eager's random numbers from the
current generator, so the TP RNG tracker's per-region streams give the same
masks compiled or not, and a compiled run follows the eager loss curve to
rounding (``tests/train/test_compile.py``). Whether it is faster was not measured
(no GPU was at hand when this was written): ``benchmarks/bench_throughput.py
--compile`` measures it.

[Note: compile inside the checkpoint]
Activation checkpointing also stands in for a forward
(:class:`hybrid.recompute.checkpointing.CheckpointedForward`). The compiled code
goes *inside* it: the checkpoint runs the compiled block in the forward pass
(without a graph) and again in the recompute (with one), so both passes run the
same code and draw the same dropout masks from the replayed RNG states, and
the block's hooks -- ZeRO-3's gather, which fires again for the recompute --
stay outside the graph as without recompute. Dynamo compiles a forward once
per grad mode, so the pass without a graph adds the graphs evaluation uses:
more compile time, not more step time. Compiling the checkpoint instead would
hand dynamo the RNG capture, the store and the autograd Function whose
backward reruns the block: side effects a graph must not capture, and the
recompute, called from backward through ``Module.__call__``, would run the
eager block rather than the compiled one. With selective recompute the
checkpointed attention core sits inside the compiled block: the stand-in is
never traced (``torch.compiler.disable``), so the block's graph breaks around
the core, which runs eagerly in both passes.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable

import torch
from torch import nn

from hybrid.parallel.comm import exclude_from_compile as exclude_collectives
from hybrid.recompute.checkpointing import (
    CheckpointedForward,
    exclude_from_compile as exclude_checkpoints,
)

_COMPILED: dict[type[nn.Module], Callable] = {}  # block class -> its compiled forward


def compiled_forward(cls: type[nn.Module]) -> Callable:
    """``torch.compile`` of ``cls.forward``, called as ``f(module, x)``: one per class,
    so every block of a class, checkpointed or not, runs the same compiled function."""
    if cls not in _COMPILED:
        _COMPILED[cls] = torch.compile(cls.forward, options={"fallback_random": True})
    return _COMPILED[cls]


def compile_blocks(blocks: Iterable[nn.Module]) -> None:
    """Compile each block's forward (in place); apply after activation checkpointing.

    A block checkpointed whole keeps its checkpoint as ``block.forward``, which
    then runs the compiled forward in both passes (see [Note: compile inside the
    checkpoint]); any other block gets it bound as its ``forward`` instance attribute.
    """
    # What a compiled block must not trace: a collective is one graph break, and so is
    # a checkpointed module inside the block (selective recompute).
    exclude_collectives()
    exclude_checkpoints()
    for block in blocks:
        compiled = compiled_forward(type(block))
        checkpoint = vars(block).get("forward")
        if isinstance(checkpoint, CheckpointedForward):
            checkpoint.inner = compiled
        else:
            block.forward = types.MethodType(compiled, block)
