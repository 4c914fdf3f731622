"""The host step's new parameters straight to their homes (stage 3 parameter offload).

Without parameter offload the host step writes every unit's new parameters
into one host copy of the shard (``OptimizerOffload.out``) and the main thread
uploads them unit by unit. With ``--offload-param`` the partitioned units'
shards already live in host memory or in ``params.swp``: a full host copy
beside them would cost e_p bytes per parameter of host memory for nothing. So
(unless the delayed update needs that copy: its parameters go home a step
later, while the step in between reads the homes) the worker writes each
chunk's new parameters where they live::

    the unit's home   where the chunk's Adam kernel writes
    HostHome          its data, in place (a chunk inside one unit); else a
                      scratch buffer, copied into it
    DiskHome          a scratch buffer, written to the unit's slot asynchronously
    none (kept whole) a compact host copy of the home-less units only, uploaded
                      by the main thread as without parameter offload (or
                      nothing: the cpu tier in fp32 uploads its master itself)

[Note: scratch buffers]
Two buffers of the largest chunk that needs one (a unit on the cpu tier, a
tile on the nvme tier), used in turn: chunk ``k`` writes buffer ``k % 2``,
whose disk writes from chunk ``k - 2`` must have ended first. So host memory
is two chunks, whatever the model size, and the writes of chunk ``k`` drain
while chunk ``k + 1`` is updated. A slot's reads wait for its writes
(:class:`~hybrid.zero.offload.nvme.homes.DiskHome`), so the next forward never
reads a half-written shard.
"""

from __future__ import annotations

import torch

from hybrid.zero.offload.contracts import ParamHome, Request


class HomeWriter:
    """Per chunk of the host step: where its new parameters go, and their delivery.

    Args:
        homes: each unit's parameter home, in shard order (None: the unit has none).
        bounds: ``bounds[i]``: where unit ``i``'s part starts in the flat shard.
        chunk_units: per chunk, (the units it overlaps, ...) as
            ``host_step.chunk_units`` gives them.
        chunks: the chunks' ``[lo, hi)`` in the flat shard.
        dtype: the parameters' training dtype.
        master_uploads: the home-less units go up from the fp32 master itself (the
            cpu tier in fp32): they need no copy.
        pin: page-locked host buffers (GPU hosts).
    """

    def __init__(self, homes: list[ParamHome | None], bounds: list[int], *,
                 chunk_units: list[tuple[list[int], list[int]]],
                 chunks: list[tuple[int, int]], dtype: torch.dtype, master_uploads: bool,
                 pin: bool):
        self.bounds, self.chunks = bounds, chunks
        self.homes = homes
        homeless = [i for i, h in enumerate(self.homes) if h is None and not master_uploads]
        n = sum(bounds[i + 1] - bounds[i] for i in homeless)
        self.out = torch.empty(n, dtype=dtype, pin_memory=pin) if homeless else None
        self._dest: list[torch.Tensor | None] = [
            None if h is None else h.target() for h in self.homes]
        off = 0
        for i in homeless:
            assert self.out is not None  # (allocated for the homeless)
            m = bounds[i + 1] - bounds[i]
            self._dest[i] = self.out[off: off + m]
            off += m
        self._touches = [t for t, _ in chunk_units]
        self._scratch_for = [self._needs_scratch(t) for t in self._touches]
        size = max((hi - lo for (lo, hi), s in zip(chunks, self._scratch_for) if s), default=0)
        self.scratch = [torch.empty(size, dtype=dtype, pin_memory=pin)
                        for _ in range(2 if size else 0)]
        # per buffer, its disk writes
        self._writes: list[list[Request]] = [[] for _ in self.scratch]

    def _needs_scratch(self, touches: list[int]) -> bool:
        if len(touches) == 1 and self._dest[touches[0]] is not None:
            return False  # the kernel writes the unit's destination in place
        return any(self._dest[i] is not None or self.homes[i] is not None for i in touches)

    def source(self, i: int) -> torch.Tensor | None:
        """Unit ``i``'s new parameters for the main thread to upload (home-less units;
        None when the fp32 master is uploaded instead)."""
        return self._dest[i] if self.homes[i] is None else None

    def out_for(self, k: int) -> torch.Tensor | None:
        """Where chunk ``k``'s kernel writes its new parameters (None: nowhere)."""
        lo, hi = self.chunks[k]
        for i in self._touches[k]:
            home = self.homes[i]
            if home is not None:
                home.wait_loaded()  # the last gather has read it out
        if not self._scratch_for[k]:
            first = self._touches[k][0] if self._touches[k] else None
            dest = None if first is None else self._dest[first]
            if first is None or dest is None:
                return None
            return dest[lo - self.bounds[first]: hi - self.bounds[first]]
        b = k % 2
        writes, self._writes[b] = self._writes[b], []
        for w in writes:  # the buffer's previous chunk is on disk
            w.wait()
        return self.scratch[b][: hi - lo]

    def deliver(self, k: int) -> None:
        """Chunk ``k``'s new parameters (in its scratch buffer) to each unit's place."""
        if not self._scratch_for[k]:
            return
        lo, hi = self.chunks[k]
        buf = self.scratch[k % 2]
        for i in self._touches[k]:
            a, b = max(lo, self.bounds[i]), min(hi, self.bounds[i + 1])
            piece = buf[a - lo: b - lo]
            dest, home = self._dest[i], self.homes[i]
            if dest is not None:
                dest[a - self.bounds[i]: b - self.bounds[i]].copy_(piece)
            elif home is not None:
                write = home.write_at(a - self.bounds[i], piece)
                if write is not None:  # (a disk home's: a home with a target is written above)
                    self._writes[k % 2].append(write)

    def nbytes(self) -> int:
        bufs = self.scratch + ([self.out] if self.out is not None else [])
        return sum(t.numel() * t.element_size() for t in bufs)
