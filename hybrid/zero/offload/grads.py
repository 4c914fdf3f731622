"""Where the host step finds this step's gradient shard: here, host memory.

The offloaded step (:mod:`hybrid.zero.offload.host_step`) reads each unit's reduced
gradient shard off the device. :class:`HostGrads` keeps the rank's whole shard in
one (pinned) host buffer; the nvme tier keeps it in ``grads.swp`` instead
(:class:`~hybrid.zero.offload.nvme.grads.SwappedGrads`). Either moves a unit's
shard with :func:`stream_copy`.
"""

from __future__ import annotations

import torch


class HostGrads:
    """The shard in host memory: ``flat`` (pinned on a GPU host), unit ``i`` at
    ``[bounds[i], bounds[i + 1])``. ``own``: False when ``flat`` is the engine's own
    flat gradient shard (a CPU device): nothing then moves."""

    def __init__(self, flat: torch.Tensor, bounds: list[int], own: bool):
        self.flat, self.bounds, self.own = flat, bounds, own

    def piece(self, i: int) -> torch.Tensor:
        return self.flat[self.bounds[i]: self.bounds[i + 1]]

    def store(self, i: int, src: torch.Tensor,
              stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """``src`` (unit ``i``'s shard) into the buffer, on ``stream`` when it is on a GPU;
        returns the copy's CUDA event, or None (done)."""
        return stream_copy(self.piece(i), src, stream)

    def load(self, i: int, dst: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """``dst`` <- unit ``i``'s piece, ordered before the current stream's next work."""
        stream_copy(dst, self.piece(i), stream, back=True)

    def values(self, i: int) -> torch.Tensor:
        return self.piece(i)

    def wait_all(self) -> None:
        """(Copies are ordered by their events: see ``OptimizerOffload._before_chunk``.)"""

    def nbytes(self) -> int:
        return self.flat.untyped_storage().nbytes() if self.own else 0


def stream_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None,
                back: bool = False) -> torch.cuda.Event | None:
    """``dst.copy_(src)``, on ``stream`` (a CUDA copy stream, after the current stream's
    work) when there is one; ``back``: the current stream then waits for it. Returns the
    copy's CUDA event, or None (done)."""
    if stream is None:
        dst.copy_(src)
        return None
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    if back:
        current.wait_event(event)
    return event
