"""ParallelState: the one object that knows the process layout.

Built once per process and passed explicitly to layers, the model, the
optimizer, checkpointing and the data loader. Nothing keeps process groups in
module globals.

The layout is :mod:`hybrid.parallel.layout`'s (TP ranks adjacent, then CP,
then DP: ``global rank = (dp_rank * cp_size + cp_rank) * tp_size + tp_rank``);
this module turns it into process groups.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybrid.diagnostics.recorder import FlightRecorder, backstop
from hybrid.parallel.comm import CommGroup, CommStats
from hybrid.parallel.layout import (
    check_layout,
    cp_group_ranks,
    dp_cp_group_ranks,
    dp_group_ranks,
    tp_group_ranks,
)
from hybrid.parallel.teardown import teardown_at_exit


@dataclass
class ParallelState:
    """Sizes, ranks and groups of this process.

    ``tp_group``, ``dp_group``, ``cp_group`` (the ranks splitting one sequence) and
    ``dp_cp_group`` (DP x CP: every rank holding the same TP slice of the
    parameters) are :class:`hybrid.parallel.comm.CommGroup` objects: every
    collective in the library runs through one of them (and is counted in
    ``comm_stats``, and recorded by ``recorder``, whose heartbeat runs until
    :meth:`close`). With CP 1, ``cp_group`` is this rank alone and ``dp_cp_group``
    is ``dp_group`` itself (no extra process group): :meth:`single` and :meth:`build`
    make them.
    """

    world_size: int
    rank: int
    tp_group: CommGroup
    dp_group: CommGroup
    world_group: CommGroup
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    comm_stats: CommStats = field(repr=False)
    recorder: FlightRecorder = field(repr=False)
    cp_group: CommGroup = field(repr=False)
    dp_cp_group: CommGroup = field(repr=False)

    @property
    def tp_size(self) -> int:
        return self.tp_group.size

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    @property
    def dp_size(self) -> int:
        return self.dp_group.size

    @property
    def dp_rank(self) -> int:
        return self.dp_group.rank

    @property
    def cp_size(self) -> int:
        return self.cp_group.size

    @property
    def cp_rank(self) -> int:
        return self.cp_group.rank

    # -- construction ----------------------------------------------------------
    @classmethod
    def single(cls, device: str | torch.device = "cpu", dump_dir: str | None = None,
               check_collectives: bool = False) -> ParallelState:
        """A one-process state (TP=1, DP=1) that needs no torch.distributed."""
        stats = CommStats()
        timeout = datetime.timedelta(minutes=10)
        rec = FlightRecorder(0, 1, None, timeout, dump_dir=dump_dir,
                             check_collectives=check_collectives)
        tp, dp, world, cp = (CommGroup(n, None, [0], 0, stats, timeout, rec)
                             for n in ("tp", "dp", "world", "cp"))
        return cls(1, 0, tp, dp, world, torch.device(device), "none", timeout, stats, rec,
                   cp_group=cp, dp_cp_group=dp)

    @classmethod
    def build(cls, tensor_model_parallel_size: int,
              timeout: datetime.timedelta = datetime.timedelta(minutes=10),
              device: torch.device | None = None, store=None,
              watch: bool | None = None, dump_dir: str | None = None,
              check_collectives: bool = False,
              context_parallel_size: int = 1) -> ParallelState:
        """Create the TP, CP and DP groups of an initialized default process group.

        Every rank must call this with the same arguments (group creation is
        itself collective). ``store``: the rendezvous store the default group
        was built from, through which the ranks explain a failed collective
        (see :mod:`hybrid.diagnostics.recorder`); without it each rank reports
        only what it saw.

        ``watch``: the recorder's heartbeat reports a collective still running
        past ``timeout`` (:mod:`hybrid.diagnostics.watch`), and the groups get
        the longer :func:`~hybrid.diagnostics.recorder.backstop` timeout. None:
        on NCCL, whose collectives return before they complete and whose own
        watchdog would end the process without a report; on gloo the waiting
        collective raises at ``timeout`` itself. ``dump_dir``
        (``--collective-dump-dir``) and ``check_collectives`` (``--check-collectives``)
        configure the flight recorder (:mod:`hybrid.diagnostics.recorder`).
        """
        tp, cp = tensor_model_parallel_size, context_parallel_size
        if not dist.is_initialized():
            check_layout(1, tp, cp)
            return cls.single(device or "cpu", dump_dir, check_collectives)
        world, rank = dist.get_world_size(), dist.get_rank()
        check_layout(world, tp, cp)
        backend = dist.get_backend()
        if device is None:
            device = _default_device(backend)
        stats = CommStats()
        watch = backend == "nccl" if watch is None else watch
        rec = FlightRecorder(rank, world, store, timeout, watch=watch, dump_dir=dump_dir,
                             check_collectives=check_collectives)
        group_timeout = backstop(timeout) if watch else timeout

        def make(name: str, all_ranks: list[list[int]]) -> CommGroup:
            mine: CommGroup | None = None
            for ranks in all_ranks:
                pg = dist.new_group(ranks, timeout=group_timeout)
                if rank in ranks:
                    mine = CommGroup(name, pg, ranks, rank, stats, timeout, rec)
            assert mine is not None  # the groups of a kind cover every rank
            return mine

        tp_group = make("tp", tp_group_ranks(world, tp, cp))
        dp_group = make("dp", dp_group_ranks(world, tp, cp))
        if cp > 1:
            cp_group = make("cp", cp_group_ranks(world, tp, cp))
            dp_cp_group = make("dp_cp", dp_cp_group_ranks(world, tp, cp))
        else:  # CP 1: this rank alone, and DP x CP is DP
            cp_group = CommGroup("cp", None, [rank], rank, stats, timeout, rec)
            dp_cp_group = dp_group
        world_group = CommGroup("world", dist.group.WORLD, list(range(world)), rank, stats,
                                timeout, rec)
        rec.start()
        return cls(world, rank, tp_group, dp_group, world_group, device, backend, timeout, stats,
                   rec, cp_group, dp_cp_group)

    def close(self) -> None:
        """Stop the flight recorder's heartbeat (the process groups stay)."""
        self.recorder.close()

    def release(self) -> None:
        """:meth:`close`, and let go of every process group: this state's collectives
        raise from here on. For the end of the process, before
        ``dist.destroy_process_group()`` (which destroys a gloo group only when it drops
        the last reference): see :mod:`hybrid.parallel.teardown`."""
        self.close()
        for g in (self.tp_group, self.dp_group, self.cp_group, self.dp_cp_group,
                  self.world_group):
            g.release()

    def describe(self) -> str:
        """Human-readable layout: which global ranks form each TP, CP and DP group."""
        w, t, c = self.world_size, self.tp_size, self.cp_size
        cp = f" x CP {c}" if c > 1 else ""
        out = (f"world {w} = TP {t}{cp} x DP {self.dp_size} (backend {self.backend}, "
               f"device {self.device.type})\n  TP groups: {tp_group_ranks(w, t, c)}")
        if c > 1:
            out += f"\n  CP groups: {cp_group_ranks(w, t, c)}"
        return out + f"\n  DP groups: {dp_group_ranks(w, t, c)}"


def _default_device(backend: str) -> torch.device:
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(tensor_model_parallel_size: int, timeout_minutes: float = 10.0,
                     backend: str | None = None, dump_dir: str | None = None,
                     check_collectives: bool = False,
                     context_parallel_size: int = 1) -> ParallelState:
    """Join the job torchrun started (env RANK/WORLD_SIZE/MASTER_ADDR...) and build groups.

    Picks nccl + cuda:LOCAL_RANK when a GPU exists, gloo + cpu otherwise. A
    single process started without torchrun gets :meth:`ParallelState.single`.
    The state's groups are torn down at interpreter exit if the program has not done
    it (:func:`~hybrid.parallel.teardown.teardown_at_exit`).
    ``dump_dir``, ``check_collectives``: the flight recorder's (see
    :meth:`ParallelState.build`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = None
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return ParallelState.single(device or "cpu", dump_dir, check_collectives)
    store = None
    if not dist.is_initialized():
        store = _attempt_store(world, timeout)
        # NCCL: the flight recorder's watch reports a hang first (see ParallelState.build)
        group_timeout = backstop(timeout) if backend == "nccl" else timeout
        dist.init_process_group(backend, timeout=group_timeout, device_id=device, store=store,
                                rank=int(os.environ["RANK"]), world_size=world)
    ps = ParallelState.build(tensor_model_parallel_size, timeout, device, store,
                             dump_dir=dump_dir, check_collectives=check_collectives,
                             context_parallel_size=context_parallel_size)
    # the groups go before the interpreter does, unless the program ends them first
    # (a gloo thread left behind can abort a finished run: hybrid/parallel/teardown.py)
    teardown_at_exit(ps)
    return ps


def _attempt_store(world: int, timeout: datetime.timedelta):
    """The rendezvous store, with keys private to this torchrun restart attempt.

    After ``torchrun --max-restarts`` restarts a job, the store still holds the
    previous attempt's keys (the dead processes' gloo/nccl addresses) under the
    same group names; a fresh prefix per attempt keeps the new processes from
    dialing them.
    """
    rank = int(os.environ["RANK"])
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=(rank == 0 and not agent_hosts_it), timeout=timeout,
                         wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hybrid/attempt_{attempt}", base)
