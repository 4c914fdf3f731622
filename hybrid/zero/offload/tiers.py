"""Where one rank's model states live off the device, built once from :class:`OffloadConfig`.

    tiers = OffloadTiers(offload, rank, units, dtype=dtype, grad_dtype=grad_dtype, device=device,
                         frozen=frozen_units)
    tiers.gds           # None, or why --offload-gds reads through host buffers here
    tiers.states        # the nvme tier's optimizer states (SwappedStates), or None
    tiers.grads         # ... and its gradient shard (SwappedGrads), or None
    tiers.send_home(unit)   # stage 3 param offload: a unit's shard, just materialized, home
    tiers.homes(units)      # ... and where each unit's shard lives now (None: the device)
    tiers.close()       # drain the I/O, delete the swap files

One :class:`~hybrid.zero.offload.nvme.swap.SwapSpace` per rank holds every swap file
(``optimizer.swp``, ``grads.swp``, ``params.swp``), so all of them are checked for space,
locked and preallocated together, before the first step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from hybrid.config.sections import OffloadConfig
from hybrid.kernels.aio import AsyncIO
from hybrid.zero.flat_unit import FlatUnit, shard_bounds
from hybrid.zero.offload.contracts import ParamHome, ShardOptimizer, SpeculationOf
from hybrid.zero.offload.homes import HostHome
from hybrid.zero.offload.nvme import gds, grads, homes, tiles
from hybrid.zero.offload.nvme.adamw import SwappedAdamW
from hybrid.zero.offload.nvme.grads import SwappedGrads
from hybrid.zero.offload.nvme.homes import DiskHome, GdsHome, disk_slots
from hybrid.zero.offload.nvme.speculative import SpeculativeUpdate
from hybrid.zero.offload.nvme.swap import SwapSpace
from hybrid.zero.offload.nvme.tiles import SwappedStates

log = logging.getLogger("hybrid")

IO_THREADS = 4  # requests are cut into pieces over these; the disk, not the CPU, bounds them


# [Note: pinned buffers at their size]
# torch's caching host allocator rounds every pinned allocation up to a power of
# two (so freed blocks are reused by size class). For the offload's buffers --
# a master shard of gigabytes, staging tiles, host gradients -- that is up to
# twice the host memory the estimator counts and the tier exists to save. Above
# PINNED_ROUND_MB the allocator is told to give the exact size
# (``pinned_max_round_threshold_mb``, a process-wide allocator setting); the
# small buffers below it keep the rounding, a constant number of them.
PINNED_ROUND_MB = 16


def host_pinning(asked: bool | None, device: torch.device) -> bool:
    """Whether the host buffers of the offload are page-locked, decided once for every
    component: ``--offload-pin-memory`` (None: yes when training on a GPU), never
    without CUDA (pinning needs it)."""
    pin = device.type == "cuda" if asked is None else asked
    if pin and torch.cuda.is_available():
        # A private call, as torch 2.13 has no public setter: the public way,
        # PYTORCH_ALLOC_CONF, is read once when the process starts, before anyone knows
        # the run will pin; torch.cuda.memory._set_allocator_settings (also private) is
        # deprecated in favour of this one. Without it the buffers are only rounded up.
        if hasattr(torch._C, "_accelerator_setAllocatorSettings"):  # (torch >= 2.9)
            torch._C._accelerator_setAllocatorSettings(
                f"pinned_max_round_threshold_mb:{PINNED_ROUND_MB}")
        return True
    return False


# [Note: frozen units at home]
# Stage 3's frozen units (hybrid/zero/units.py, [Note: frozen units]) -- a LoRA base,
# often most of the model -- live in the same homes as the trainable units under
# --offload-param: a HostHome each on the cpu tier, a slot of params.swp each on the
# nvme tier (the file sized for them too), so outside forward and backward the device
# holds none of their bytes. A gather loads them like any unit's (FlatUnit.start_gather)
# and the gatherer's read ahead reaches them in the recorded order. They have no
# optimizer piece: the optimizer's flat shard and its homes (:meth:`homes`, asked for
# the engine's units) leave them out, so no step writes them back; what changes a frozen
# value (a checkpoint's load, a GatheredParameters modifier) writes through the home
# (FlatUnit.write_shard).


class OffloadTiers:
    """The swap space, the I/O threads and the optimizer states of the nvme tier, and
    the parameter homes of ``--offload-param``.

    ``units``: the engine's units (their owned sizes, in shard order, make the
    optimizer's flat shard); ``frozen``: stage 3's frozen units, which take parameter
    homes too (slots in params.swp) but no optimizer state ([Note: frozen units at
    home]); ``dtype``: the parameters' training dtype;
    ``grad_dtype``: the gradients'; ``device``: the training device (GDS reads land
    there). ``gds_file``: the cuFile binding (``torch.cuda.gds.GdsFile``; a test's
    stand-in).
    """

    def __init__(self, cfg: OffloadConfig, rank: int, units: list[FlatUnit], *,
                 dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device,
                 frozen: Sequence[FlatUnit] = (), gds_file: gds.FileClass | None = None):
        self.cfg, self.device = cfg, device
        self.pin = host_pinning(cfg.pin_memory, device)
        self.space: SwapSpace | None = None
        self.io: AsyncIO | None = None
        self.states: SwappedStates | None = None
        self.grads: SwappedGrads | None = None
        self.reader: gds.GdsReader | None = None
        self.gds: str | None = None  # why --offload-gds is not used here (None: used, or not asked)
        self._homes: list[ParamHome] = []
        self._home_of: dict[int, ParamHome] = {}  # id(unit) -> its home
        n = sum(u.own_hi - u.own_lo for u in units)  # (the optimizer's: no frozen unit)
        # [Note: frozen units at home]
        self._partitioned = ([u for u in units if u.partition_params] + list(frozen)
                             if cfg.param else [])
        self._slot_of = {id(u): k for k, u in enumerate(self._partitioned)}
        sizes = {}
        if cfg.optimizer == "nvme":
            sizes[tiles.FILE] = SwappedStates.space_for(n, cfg.tile(n))
            sizes[grads.FILE] = SwappedGrads.space_for(n, cfg.tile(n), grad_dtype)
        if cfg.param == "nvme":
            elem = torch.empty((), dtype=dtype).element_size()
            self._slots, sizes[homes.FILE] = disk_slots(
                [u.shard_size for u in self._partitioned], elem)
        if not sizes:
            return
        assert cfg.nvme_path is not None  # (the checks: an nvme tier names its directory)
        self.space = SwapSpace(cfg.nvme_path, rank, sizes)
        try:
            self.io = AsyncIO(threads=IO_THREADS)
            if cfg.optimizer == "nvme":
                self.states = SwappedStates(n, cfg.tile(n), self.space, self.io,
                                            buffers=cfg.buffer_count, pin=self.pin)
                self.grads = SwappedGrads(self.space, self.io, shard_bounds(units),
                                          tile=cfg.tile(n), dtype=grad_dtype, pin=self.pin)
                self.states.attach_grads(self.grads, self.pin)
            if cfg.param == "nvme" and cfg.gds:
                self._open_gds(rank, gds_file)
        except BaseException:
            self.close()
            raise

    def _open_gds(self, rank: int, gds_file: gds.FileClass | None) -> None:
        """GDS reads of params.swp if the probe says they work; else the reason, kept
        in ``self.gds`` (hybrid/zero/offload/nvme/gds.py, [Note: never required])."""
        assert self.space is not None  # (opened just before)
        self.gds = gds.probe(self.space.dir, self.device, gds_file)
        if self.gds is None:
            self.reader = gds.GdsReader(self.space.files[homes.FILE].path, rank,
                                        file_cls=gds_file)
        elif rank == 0:  # (every rank probes its own directory; one line for the job)
            log.warning("--offload-gds: GPUDirect Storage does not work here (%s); "
                        "params.swp is read through %shost buffers", self.gds,
                        "pinned " if self.pin else "")

    @torch.no_grad()
    def send_home(self, u: FlatUnit) -> None:
        """Move ``u``'s shard (just materialized) to its home, if it has one -- unit by
        unit, so host memory never holds every shard at once."""
        k = self._slot_of.get(id(u))
        if k is None:
            return
        home: ParamHome
        if self.cfg.param == "cpu":
            home = HostHome(u.shard, self.pin)
        else:
            assert self.space is not None and self.io is not None  # (--offload-param nvme)
            offset, numel, dtype = self._slots[k], u.shard_size, u.shard.dtype
            disk = (DiskHome(self.space, self.io, offset=offset, numel=numel, dtype=dtype,
                             pin=self.pin) if self.reader is None
                    else GdsHome(self.space, self.io, self.reader, offset=offset, numel=numel,
                                 dtype=dtype, device=self.device))
            disk.store(u.shard).synchronize()
            home = disk
        u.offload_to(home)
        self._homes.append(home)
        self._home_of[id(u)] = home

    def speculation_of(self, opt: ShardOptimizer, dtype: torch.dtype) -> SpeculationOf | None:
        """What makes the host step's speculative update of ``opt`` ([Note: what starts
        before the step] in hybrid/zero/offload/host_step.py): the nvme tier's optimizer,
        its gradients swapped with its tiles; None otherwise (the host step makes none).
        ``dtype``: the parameters' training dtype."""
        if isinstance(opt, SwappedAdamW) and self.grads is not None \
                and opt.states.grads is self.grads:
            return functools.partial(SpeculativeUpdate, opt, self.grads, dtype=dtype,
                                     pin=self.pin)
        return None

    def homes(self, units: list[FlatUnit]) -> list[ParamHome | None]:
        """Each unit's parameter home (None: its shard stays on the device), in order."""
        return [self._home_of.get(id(u)) for u in units]

    def param_host_bytes(self) -> int:
        """Host bytes of the parameter homes (a shard each on the cpu tier, the reads in
        flight on the nvme tier); the optimizer's staging is the optimizer's to count."""
        return sum(h.host_bytes() for h in self._homes)

    def param_device_bytes(self) -> int:
        """Device bytes of the GPUDirect reads in flight (--offload-gds)."""
        return sum(h.device_bytes() for h in self._homes)

    def disk_bytes(self) -> int:
        return 0 if self.space is None else self.space.nbytes()

    def close(self) -> None:
        """Let every read and write in flight end, then delete the swap files
        (scratch: a restart rebuilds them from its checkpoint)."""
        try:
            if self.grads is not None:
                self.grads.close()
            if self.states is not None:
                self.states.close()
            for h in self._homes:
                h.store_done()
        finally:
            if self.reader is not None:
                self.reader.close()
                self.reader = None
            if self.io is not None:
                self.io.close()
                self.io = None
            if self.space is not None:
                self.space.close()
                self.space = None
