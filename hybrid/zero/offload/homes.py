"""Stage 3 parameter offload: where a partitioned unit's shard lives between its gathers.

Without offload a rank keeps its shard of every partitioned unit on the device
and all-gathers from it. With ``--offload-param`` the shard has a *home* off
the device, and the device holds it only while the unit's gather runs::

    home (host memory, or the rank's params.swp)  --load-->  device shard  --all-gather-->  unit

    tier  home                         load                          store (after the step)
    cpu   a host tensor (pinned, GPU)  copy (async H2D on a GPU)     copy from the host step
    nvme  its slot in params.swp       read (prefetched), copy       asynchronous write
    (with --offload-gds where GPUDirect Storage works: read straight into device memory)

The disk tier's homes (and their reads ahead, writes behind) are in
:mod:`hybrid.zero.offload.nvme.homes`.
"""

from __future__ import annotations

import torch


class HostHome:
    """The cpu tier: the shard's values in host memory."""

    def __init__(self, values: torch.Tensor, pin: bool):
        self.data = torch.empty(values.numel(), dtype=values.dtype, pin_memory=pin)
        self.data.copy_(values)
        # the last load's copy to the device has run (a CUDA load)
        self._copying: torch.cuda.Event | None = None

    def prefetch(self) -> None:
        """Nothing to do: the shard is already in host memory."""

    def load_into(self, shard: torch.Tensor) -> None:
        shard.copy_(self.data, non_blocking=shard.is_cuda)
        if shard.is_cuda:
            self._copying = torch.cuda.Event()
            self._copying.record(torch.cuda.current_stream(shard.device))

    def target(self) -> torch.Tensor:
        """Where the host step may write the new shard in place (after
        :meth:`wait_loaded`)."""
        return self.data

    def wait_loaded(self) -> None:
        """The last load has read ``data`` out: it may be rewritten."""
        if self._copying is not None:
            self._copying.synchronize()
            self._copying = None

    def write_at(self, start: int, values: torch.Tensor) -> None:
        """Shard elements ``[start, start + len)`` <- ``values``, at once (after
        :meth:`wait_loaded`); nothing to wait for."""
        self.data[start: start + values.numel()].copy_(values)

    def store(self, values: torch.Tensor) -> None:
        self.wait_loaded()
        self.data.copy_(values)  # done: nothing to wait for

    def store_done(self) -> None:
        """(Every store ends in the call.)"""

    def values(self) -> torch.Tensor:
        """The shard as it is now, in host memory (for reading: diagnostics)."""
        return self.data

    def host_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def device_bytes(self) -> int:
        return 0
