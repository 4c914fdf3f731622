"""ParallelState: the one object that knows the process layout.

Built once per process and passed explicitly to layers, the model, the
optimizer, checkpointing and the data loader. Nothing keeps process groups in
module globals.

The layout is :mod:`hybrid.parallel.layout`'s (TP ranks adjacent, then CP, then DP,
PP outermost: ``global rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) *
tp_size + tp_rank``); this module turns it into process groups.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybrid.diagnostics.recorder import FlightRecorder, backstop
from hybrid.parallel.comm import CommGroup, CommStats
from hybrid.parallel.layout import ExpertLayout, Layout
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

    Pipeline parallelism: ``pp_group`` holds this rank's pipeline, one rank per stage in
    stage order (``pp_rank`` is this rank's stage; activations go to
    :attr:`next_stage_rank` and gradients back to :attr:`prev_stage_rank`).
    ``embedding_group`` holds the first and the last stage's ranks of this pipeline
    (the same TP, CP and DP position), which keep the two copies of a tied word
    embedding and sum its gradient over it. On a middle stage, and at PP 1 (where the
    first stage is the last), it is this rank alone: a one-rank group, whose collectives
    return at once, so a caller need not ask first (:attr:`in_embedding_group` says when
    it matters). At PP 1 ``pp_group`` is this rank alone too; neither makes a process
    group then, and the ranks and other groups are exactly those of TP x CP x DP.

    Expert parallelism (the MoE layers' layout, :class:`hybrid.parallel.layout.ExpertLayout`):
    ``ep_group`` holds the ranks one MoE layer's experts are split over (tokens reach
    their experts' ranks by all-to-all within it), ``edp_group`` the ranks holding the
    same experts (their gradients are reduced, and ZeRO shards them, over it),
    ``etp_group`` the ranks each expert's hidden units are split over (expert tensor
    parallelism, ETP). At EP 1 and ETP 1 ``ep_group`` and ``etp_group`` are this rank
    alone and ``edp_group`` is ``dp_cp_group`` itself: no extra process group.
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
    pp_group: CommGroup = field(repr=False)
    embedding_group: CommGroup = field(repr=False)
    ep_group: CommGroup = field(repr=False)
    edp_group: CommGroup = field(repr=False)
    etp_group: CommGroup = field(repr=False)

    @property
    def ep_size(self) -> int:
        return self.ep_group.size

    @property
    def etp_size(self) -> int:
        return self.etp_group.size

    @property
    def experts_split(self) -> bool:
        """The MoE layers' experts are split over ranks (EP or ETP above 1): their
        parameters are marked and reduced over ``edp_group``."""
        return self.ep_group.size * self.etp_group.size > 1

    @property
    def ep_rank(self) -> int:
        return self.ep_group.rank

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

    @property
    def pp_size(self) -> int:
        return self.pp_group.size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0: the first, which embeds the tokens)."""
        return self.pp_group.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_group.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_group.rank == self.pp_group.size - 1

    @property
    def in_embedding_group(self) -> bool:
        """This rank holds a copy of the word embedding: the first or the last stage."""
        return self.is_first_stage or self.is_last_stage

    @property
    def prev_stage_rank(self) -> int:
        """The global rank of the previous stage of this pipeline (the same TP, CP and DP
        position), around the ring: the first stage's is the last stage (where an
        interleaved schedule's chunk v + 1 takes chunk v's output). This rank at PP 1."""
        g = self.pp_group
        return g.ranks[(g.rank - 1) % g.size]

    @property
    def next_stage_rank(self) -> int:
        """The global rank of the next stage of this pipeline, around the ring: the last
        stage's is the first stage. This rank at PP 1."""
        g = self.pp_group
        return g.ranks[(g.rank + 1) % g.size]

    # -- construction ----------------------------------------------------------
    @classmethod
    def single(cls, device: str | torch.device = "cpu", dump_dir: str | None = None,
               check_collectives: bool = False) -> ParallelState:
        """A one-process state (TP=1, DP=1, PP=1) that needs no torch.distributed."""
        stats = CommStats()
        timeout = datetime.timedelta(minutes=10)
        rec = FlightRecorder(0, 1, None, timeout, dump_dir=dump_dir,
                             check_collectives=check_collectives)
        tp, dp, world, cp, pp, emb, ep, etp = (
            CommGroup(n, None, [0], 0, stats, timeout, rec)
            for n in ("tp", "dp", "world", "cp", "pp", "embedding", "ep", "etp"))
        return cls(1, 0, tp, dp, world, torch.device(device), "none", timeout, stats, rec,
                   cp_group=cp, dp_cp_group=dp, pp_group=pp, embedding_group=emb,
                   ep_group=ep, edp_group=dp, etp_group=etp)

    @classmethod
    def build(cls, tensor_model_parallel_size: int,
              timeout: datetime.timedelta = datetime.timedelta(minutes=10),
              device: torch.device | None = None, store=None,
              watch: bool | None = None, dump_dir: str | None = None,
              check_collectives: bool = False,
              context_parallel_size: int = 1,
              pipeline_model_parallel_size: int = 1,
              expert_model_parallel_size: int = 1,
              expert_tensor_parallel_size: int = 1) -> ParallelState:
        """Create the TP, CP, DP and PP groups of an initialized default process group, and
        the expert groups (EP or ETP > 1: the ETP x EP groups folding over a stage's TP x
        CP x DP ranks).

        Every rank must call this with the same arguments. Group creation is local to
        each group: a rank creates only the groups it belongs to, one per kind, with
        torch's ``new_group(..., use_local_synchronization=True)`` (O(1) calls per kind
        and O(group size) arithmetic; see :func:`_create_groups` for what that asks of the
        caller). ``store``: the
        rendezvous store the default group was built from, through which the ranks
        explain a failed collective
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
        pp, ep = pipeline_model_parallel_size, expert_model_parallel_size
        etp = expert_tensor_parallel_size
        if not dist.is_initialized():
            Layout(1, tp, cp, pp)  # (the check: sizes above 1 do not fit one process)
            ExpertLayout(1, etp, ep, pp)
            return cls.single(device or "cpu", dump_dir, check_collectives)
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = Layout(world, tp, cp, pp)
        experts = ExpertLayout(world, etp, ep, pp)
        backend = dist.get_backend()
        if device is None:
            device = _default_device(backend)
        stats = CommStats()
        watch = backend == "nccl" if watch is None else watch
        rec = FlightRecorder(rank, world, store, timeout, watch=watch, dump_dir=dump_dir,
                             check_collectives=check_collectives)
        group_timeout = backstop(timeout) if watch else timeout

        def alone(name: str) -> CommGroup:
            return CommGroup(name, None, [rank], rank, stats, timeout, rec)

        # this rank's group of each kind, in the same kind order on every rank
        kinds = ["tp", "dp"] + (["cp", "dp_cp"] if cp > 1 else []) + (["pp"] if pp > 1 else [])
        mine = {k: layout.group_of(k, rank) for k in kinds}
        if pp > 1:  # a middle stage's is itself alone (see _create_groups)
            mine["embedding"] = layout.embedding_group_of(rank)
        split = [k for k, n in (("ep", ep), ("etp", etp)) if n > 1]
        if split:
            mine.update((k, experts.group_of(k, rank)) for k in (*split, "edp"))

        def every(kind: str) -> list[list[int]]:
            if kind == "embedding":
                return layout.embedding_groups()
            return (experts.groups(kind) if kind in ("ep", "edp", "etp")
                    else layout.groups(kind))
        pgs = _create_groups(every, mine, group_timeout, device)
        groups = {k: CommGroup(k, pgs[k], mine[k], rank, stats, timeout, rec)
                  for k in mine if len(mine[k]) > 1 or k != "embedding"}
        tp_group, dp_group = groups["tp"], groups["dp"]
        # CP 1: this rank alone, and DP x CP is DP
        cp_group = groups["cp"] if cp > 1 else alone("cp")
        dp_cp_group = groups["dp_cp"] if cp > 1 else dp_group
        # PP 1: one stage, first and last at once; no process group
        pp_group = groups["pp"] if pp > 1 else alone("pp")
        embedding_group = groups["embedding"] if "embedding" in groups else alone(
            "embedding")
        world_group = CommGroup("world", dist.group.WORLD, list(range(world)), rank, stats,
                                timeout, rec)
        # EP 1 (ETP 1): this rank alone, and the experts' data-parallel group is DP x CP
        ep_group = groups["ep"] if ep > 1 else alone("ep")
        etp_group = groups["etp"] if etp > 1 else alone("etp")
        edp_group = groups["edp"] if split else dp_cp_group
        rec.start()
        return cls(world, rank, tp_group, dp_group, world_group, device, backend, timeout, stats,
                   rec, cp_group, dp_cp_group, pp_group, embedding_group, ep_group, edp_group,
                   etp_group)

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
                  self.pp_group, self.embedding_group, self.world_group, self.ep_group,
                  self.edp_group, self.etp_group):
            g.release()

    def describe(self) -> str:
        """Human-readable layout: which global ranks form each TP, CP, DP and PP group
        (and, with PP, each embedding group)."""
        w, t, c, p = self.world_size, self.tp_size, self.cp_size, self.pp_size
        layout = Layout(w, t, c, p)
        cp = f" x CP {c}" if c > 1 else ""
        pp = f" x PP {p}" if p > 1 else ""
        out = (f"world {w} = TP {t}{cp} x DP {self.dp_size}{pp} (backend {self.backend}, "
               f"device {self.device.type})\n  TP groups: {layout.groups('tp')}")
        if c > 1:
            out += f"\n  CP groups: {layout.groups('cp')}"
        out += f"\n  DP groups: {layout.groups('dp')}"
        if p > 1:
            out += (f"\n  PP groups: {layout.groups('pp')}"
                    f"\n  embedding groups: {layout.embedding_groups()}")
        if self.experts_split:
            experts = ExpertLayout(w, self.etp_size, self.ep_size, p)
            if self.etp_size > 1:
                out += f"\n  ETP groups: {experts.groups('etp')}"
            out += (f"\n  EP groups: {experts.groups('ep')}"
                    f"\n  expert DP groups: {experts.groups('edp')}")
        return out


def _create_groups(every: Callable[[str], list[list[int]]], mine: dict[str, list[int]],
                   timeout: datetime.timedelta, device: torch.device) -> dict[str, object]:
    """This rank's process group of each kind in ``mine`` (kind: its ranks, in the same
    kind order on every rank), made by its members alone; ``every(kind)``: all the groups
    of a kind (the fallback below creates them all).

    ``dist.new_group(ranks, use_local_synchronization=True)`` is called by the members of
    ``ranks`` only (a non-member returning at once is what makes it O(1) calls per kind).
    What torch 2.13 (``distributed_c10d._new_group_with_tag``) asks of its callers:

    * The group's name, under which its members meet in the default group's store, is a
      hash of its ranks and of how many process groups the calling process holds
      (``_world.pg_names``), not the every-rank counter plain ``new_group`` advances. So
      the members of a group must hold equally many groups when they create it. Here
      each rank creates exactly one group per kind, in the same order; a middle stage
      creates a one-rank "embedding" group of its own for that (unused: its
      :class:`CommGroup` has no process group), so every rank holds the same number
      after this too. Groups a program made before on some ranks only would break that
      (the members would wait on different keys until ``timeout``): one all-reduce over
      the default group compares the counts first, and where they differ every rank
      creates every group, as plain ``new_group`` requires.
    * NCCL with an eagerly initialized default group (``init_process_group(device_id=)``,
      which :func:`init_distributed` passes) splits each new communicator from the
      default one, ``ncclCommSplit`` being collective over every rank of it. Because
      each kind's groups (the embedding kind's with those one-rank groups) cover every
      rank once, each rank makes one split per kind in the same order, each with its
      group's colour: together they are the one split into that kind's groups.
    * MPI refuses it (every rank creates every group there); gloo, NCCL and torch's fake
      group take it.
    """
    mpi = dist.get_backend() == "mpi"
    if not mpi and _group_counts_agree(device):
        return {kind: dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
                for kind, ranks in mine.items()}
    if not mpi:
        warnings.warn("ParallelState.build: the ranks hold different numbers of process "
                      "groups, so each rank creates every group (O(world) new_group calls)",
                      stacklevel=3)
    pgs: dict[str, object] = {}
    for kind, ranks in mine.items():
        for group in every(kind):  # (the same order on every rank: the call is collective)
            pg = dist.new_group(group, timeout=timeout)
            if group == ranks:
                pgs[kind] = pg
    pgs.setdefault("embedding", None)  # a middle stage's, which it is in none of
    return pgs


def _group_counts_agree(device: torch.device) -> bool:
    """Every rank holds as many process groups as this one (see :func:`_create_groups`):
    one all-reduce over the default group. False where torch does not say."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    if names is None:
        return False
    n = len(names)
    if dist.get_backend() != "nccl":
        device = torch.device("cpu")
    t = torch.tensor([n, -n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist() == [n, -n]


def _default_device(backend: str) -> torch.device:
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(tensor_model_parallel_size: int, timeout_minutes: float = 10.0,
                     backend: str | None = None, dump_dir: str | None = None,
                     check_collectives: bool = False,
                     context_parallel_size: int = 1,
                     pipeline_model_parallel_size: int = 1,
                     expert_model_parallel_size: int = 1,
                     expert_tensor_parallel_size: int = 1) -> ParallelState:
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
                             context_parallel_size=context_parallel_size,
                             pipeline_model_parallel_size=pipeline_model_parallel_size,
                             expert_model_parallel_size=expert_model_parallel_size,
                             expert_tensor_parallel_size=expert_tensor_parallel_size)
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
