"""The one door every collective goes through.

A :class:`CommGroup` wraps one torch process group (the TP group or the DP group
of this rank). Its methods run the collective over exactly that group, count
the bytes this rank moves, and turn a backend failure (a dead peer, a timeout)
into a :class:`CollectiveError` that names the operation, the group and the
global ranks involved, so a job ends with a message instead of a hang.

Every collective is numbered per group and recorded, with its caller, by the
process's :class:`hybrid.diagnostics.recorder.FlightRecorder` (no I/O on this
path). When one fails the ranks compare notes and one of them raises the
report naming the ranks that never reached it (``CollectiveError.reporter``);
the others raise a one-line pointer to it. With ``--check-collectives``
(``recorder.check_collectives``) the ranks of a group first agree on op,
shape and dtype (:mod:`hybrid.diagnostics.fingerprint`).

[Note: what the byte counters count]
Counters record the volume a rank *sends* under the bandwidth-optimal ring
algorithm, which is also what it receives, so it is the figure the ZeRO paper
calls "communication volume":

* all-reduce of S bytes over n ranks:      2 * S * (n - 1) / n
* reduce-scatter of an S-byte input:       S * (n - 1) / n
* all-gather into an S-byte output:        S * (n - 1) / n
* broadcast of S bytes:                    S * (n - 1) / n
* all-to-all of an S-byte input:           S * (n - 1) / n
* ring exchange of S bytes (p2p):          S  (sent to the next rank, as much received)

A group of one rank moves nothing and its collectives return immediately
without touching torch.distributed, so single-process code runs the same path.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybrid.diagnostics import fingerprint
from hybrid.diagnostics.recorder import FlightRecorder
from hybrid.errors import CollectiveError

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "p2p")

# torch 2.13 renamed the tensor-in/tensor-out collectives; keep older torch working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Bytes this process moved, per collective kind. Shared by all its groups."""

    bytes: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    calls: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    # Largest message (elements of the bigger side) per kind: what bucket sizes bound.
    max_numel: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    # Seconds this process spent blocked in collectives (sync calls and waits):
    # step time minus this is the time it kept others waiting, or not.
    wait_s: float = 0.0

    def add(self, kind: str, nbytes: float, numel: int = 0) -> None:
        self.bytes[kind] += int(round(nbytes))
        self.calls[kind] += 1
        self.max_numel[kind] = max(self.max_numel[kind], numel)

    def snapshot(self) -> dict:
        return dict(self.bytes)

    def reset(self) -> None:
        for k in KINDS:
            self.bytes[k] = 0
            self.calls[k] = 0
            self.max_numel[k] = 0
        self.wait_s = 0.0


class _Requests:
    """Several point-to-point requests waited on as one (a ring exchange's send and recv)."""

    def __init__(self, works):
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()

    def is_completed(self) -> bool:  # (the NCCL heartbeat's question)
        return all(w.is_completed() for w in self._works)


class _Work:
    """Handle of an async collective whose ``wait`` reports failures like the sync path."""

    def __init__(self, work, group=None, entry=None):
        self._work = work
        self._group = group
        self._entry = entry

    def wait(self) -> None:
        if self._work is None:
            return
        self._group._wait(self._work.wait, self._entry)
        self._work = None


class CommGroup:
    """One process group of this rank, with counted, named, timed collectives.

    Attributes:
        name: "tp" or "dp" (or "world"), used in error messages.
        ranks: the global ranks of the group, in group-rank order.
        rank: this process's rank inside the group.
        size: number of ranks in the group.
    """

    def __init__(self, name: str, pg, ranks: list[int], global_rank: int,
                 stats: CommStats, timeout: datetime.timedelta,
                 recorder: FlightRecorder | None = None):
        self.name = name
        self.pg = pg
        self.ranks = list(ranks)
        self.global_rank = global_rank
        self.rank = self.ranks.index(global_rank)
        self.size = len(self.ranks)
        self.stats = stats
        self.timeout = timeout
        self.seq = 0  # collectives issued on this group so far (the last one's number)
        self.released = False  # release() let go of the process group
        self.recorder = recorder or FlightRecorder(global_rank, 1, None, timeout)
        if self.size > 1:
            self.recorder.register(self)

    def __repr__(self) -> str:
        return f"CommGroup({self.name}, ranks={self.ranks})"

    def release(self) -> None:
        """Let go of the torch process group (its teardown: hybrid/parallel/teardown.py);
        a collective over more than this rank raises from here on."""
        self.pg, self.released = None, True

    # -- helpers -------------------------------------------------------------
    def _run(self, op: str, kind: str, nbytes: float, t: torch.Tensor, fn, async_op: bool,
             extra: int = 0, pairwise: bool = False, peers=None, about: str | None = None,
             heard=None):
        """Count, number and record the collective, then run it (see the module doc).
        ``pairwise``: point-to-point between some ranks of the group, which the others
        do not join, so ``--check-collectives`` has nothing to compare it with; ``peers``
        and ``heard`` (global ranks: all at the other end, those received from) and
        ``about`` then go to the flight recorder's entry."""
        if self.released:  # (pg None would mean torch's default group: never that)
            raise RuntimeError(f"{op} over the {self.name} group {self.ranks} after its "
                               f"process group was released at teardown")
        self.stats.add(kind, nbytes, t.numel())
        rec = self.recorder
        entry = rec.issue(self, op, t, peers, about, heard)
        if rec.check_collectives and not pairwise:
            t0 = time.perf_counter()
            rec.begin_wait(entry)
            try:
                mismatch = fingerprint.check(self, entry, extra, t.numel(), t.device)
            except Exception as e:  # noqa: BLE001 - a peer never came to compare
                raise self._failure(entry, e) from e
            finally:
                self.stats.wait_s += time.perf_counter() - t0  # blocked too
            rec.waiting = None
            if mismatch is not None:
                entry.state = "failed"
                raise self._error(*rec.mismatch(mismatch))
        if async_op or rec.watch is not None:
            try:
                work = fn(True)
            except Exception as e:  # noqa: BLE001
                raise self._failure(entry, e) from e
            if rec.watch is not None:  # NCCL: the heartbeat watches it complete
                rec.watch.add(entry, work)
            if async_op:
                return _Work(work, self, entry)
            fn = work.wait  # queues the wait on NCCL; blocks on gloo
        self._wait(fn, entry)
        return None

    def _wait(self, fn, entry) -> None:
        """Run ``fn`` (a sync collective, or an async handle's ``wait``), timed as blocked."""
        rec = self.recorder
        rec.begin_wait(entry)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised with the report
            raise self._failure(entry, e) from e
        finally:
            self.stats.wait_s += time.perf_counter() - t0
        rec.end_wait(entry)

    def _failure(self, entry, error: Exception) -> CollectiveError:
        return self._error(*self.recorder.failed(entry, str(error)))

    def _error(self, message: str, reporter: bool) -> CollectiveError:
        return CollectiveError(message, reporter,
                               self.recorder.reported if reporter else None)

    def _frac(self) -> float:
        return (self.size - 1) / self.size

    # -- collectives ---------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """In-place all-reduce of ``t`` over this group."""
        if self.size == 1:
            return _Work(None) if async_op else None
        nbytes = 2 * t.numel() * t.element_size() * self._frac()
        return self._run("all_reduce", "all_reduce", nbytes, t,
                         lambda a=False: dist.all_reduce(t, op=op, group=self.pg, async_op=a),
                         async_op, fingerprint.extra_code("all_reduce", op))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Gather equal-size ``inp`` of every rank into contiguous ``out``.

        ``out`` holds ``size * inp.numel()`` elements, rank chunks in order
        (flat: the shapes only need matching element counts).
        """
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return _Work(None) if async_op else None
        nbytes = out.numel() * out.element_size() * self._frac()
        return self._run("all_gather", "all_gather", nbytes, out,
                         lambda a=False: _all_gather_single(out.view(-1), inp.reshape(-1),
                                                           group=self.pg, async_op=a),
                         async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op=dist.ReduceOp.SUM,
                       async_op: bool = False):
        """Sum ``inp`` over ranks; leave flat chunk ``rank`` (out.numel() elements) in ``out``."""
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return _Work(None) if async_op else None
        nbytes = inp.numel() * inp.element_size() * self._frac()
        return self._run("reduce_scatter", "reduce_scatter", nbytes, inp,
                         lambda a=False: _reduce_scatter_single(out.view(-1), inp.reshape(-1),
                                                               op=op, group=self.pg,
                                                               async_op=a),
                         async_op, fingerprint.extra_code("reduce_scatter", op))

    def broadcast(self, t: torch.Tensor, src: int = 0, async_op: bool = False):
        """Broadcast ``t`` from group rank ``src`` to the group, in place."""
        if self.size == 1:
            return _Work(None) if async_op else None
        nbytes = t.numel() * t.element_size() * self._frac()
        return self._run("broadcast", "broadcast", nbytes, t,
                         lambda a=False: dist.broadcast(t, src=self.ranks[src], group=self.pg,
                                                       async_op=a),
                         async_op, fingerprint.extra_code("broadcast", src=src))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Send flat chunk ``j`` of ``inp`` (``inp.numel() / size`` elements) to group rank
        ``j``; chunk ``j`` of ``out`` is what rank ``j`` sent here (Ulysses' exchange)."""
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return _Work(None) if async_op else None
        nbytes = inp.numel() * inp.element_size() * self._frac()
        return self._run("all_to_all", "all_to_all", nbytes, inp,
                         lambda a=False: dist.all_to_all_single(out.view(-1), inp.reshape(-1),
                                                                group=self.pg, async_op=a),
                         async_op)

    def all_to_all_v(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                     in_splits: list[int]) -> None:
        """Send rows ``[sum(in_splits[:j]), + in_splits[j])`` of ``inp`` to group rank ``j``;
        rows ``[sum(out_splits[:j]), + out_splits[j])`` of ``out`` are what rank ``j`` sent
        here (an MoE layer's tokens to their experts' ranks: unequal counts, each pair
        agreed before). Rows are dim 0; recorded with the ``(size,)`` send counts, which
        every rank's fingerprint shapes alike."""
        if self.size == 1:
            out.copy_(inp.reshape(out.shape))
            return None
        row = math.prod(inp.shape[1:])  # (a rank may send no rows at all)
        sent = (sum(in_splits) - in_splits[self.rank]) * row * inp.element_size()
        counts = torch.tensor(in_splits, dtype=torch.int64)
        return self._run("all_to_all_v", "all_to_all", sent, counts,
                         lambda a=False: dist.all_to_all_single(
                             out, inp, output_split_sizes=out_splits,
                             input_split_sizes=in_splits, group=self.pg, async_op=a), False)

    def ring_exchange(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Send ``inp`` to the next group rank (``rank + 1`` mod size) and receive the
        previous rank's into ``out`` (same shape): one step of ring attention. Every
        rank of the group takes part, so it is numbered and checked like a collective."""
        if self.size == 1:
            out.copy_(inp)
            return _Work(None) if async_op else None
        nxt, prv = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]

        def start(a=False):
            ops = [dist.P2POp(dist.isend, inp.contiguous(), nxt, group=self.pg),
                   dist.P2POp(dist.irecv, out, prv, group=self.pg)]
            works = _Requests(dist.batch_isend_irecv(ops))
            if not a:
                works.wait()
            return works
        return self._run("ring_exchange", "p2p", inp.numel() * inp.element_size(), inp, start,
                         async_op)


    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], what: str, async_op: bool = False,
                 about: str | None = None):
        """Point-to-point: each ``(tensor, group rank)`` of ``sends`` goes to that rank, each
        of ``recvs`` is filled from it, batched into one launch (a pipeline's activations
        and gradients between neighbouring stages). Only the ranks named take part.
        ``what`` names it in the flight recorder and in errors (a pipeline action's text
        form), ``about`` says it in words there (the stage, the action, the micro-batch:
        the head of the report when it does not complete; [Note: a stuck exchange] in
        hybrid/diagnostics/report.py). Counted as p2p: the bytes this rank sends."""
        if not sends and not recvs:
            return _Work(None) if async_op else None
        first = (sends or recvs)[0][0]

        def start(a=False):
            ops = ([dist.P2POp(dist.isend, t.contiguous(), self.ranks[r], group=self.pg)
                    for t, r in sends]
                   + [dist.P2POp(dist.irecv, t, self.ranks[r], group=self.pg) for t, r in recvs])
            works = _Requests(dist.batch_isend_irecv(ops))
            if not a:
                works.wait()
            return works
        nbytes = sum(t.numel() * t.element_size() for t, _ in sends)
        peers = sorted({self.ranks[r] for _, r in sends + recvs})
        heard = sorted({self.ranks[r] for _, r in recvs})
        return self._run(what, "p2p", nbytes, first, start, async_op, pairwise=True,
                         peers=peers, about=about, heard=heard)


# [Note: collectives under torch.compile] The door's bookkeeping (the recorder's frames
# and clock, the byte counters) is Python that dynamo cannot trace: each piece of it
# would split a compiled graph again. Disabled as a whole, a collective inside a compiled
# forward (TP's all-reduce) is one clean break, run eagerly. Done by --compile only:
# torch.compiler.disable imports torch._dynamo (about 2 s), which a run without
# --compile never needs.
def exclude_from_compile() -> None:
    """Make every collective of the door one graph break for torch.compile (idempotent)."""
    if not getattr(CommGroup._run, "_hybrid_excluded", False):
        run = torch.compiler.disable(CommGroup._run)
        run._hybrid_excluded = True
        # patched once, lazily, not declared so: torch.compiler.disable imports dynamo
        CommGroup._run = run  # type: ignore[method-assign]
