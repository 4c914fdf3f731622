"""The words of a collective failure report, from the ranks' records (pure functions).

A record is what :meth:`hybrid.diagnostics.recorder.FlightRecorder.record`
publishes: per group the last sequence number and last two entries, where the
rank is blocked if it is, where its main thread is, its host, and when it was
written. :func:`explain` turns the failing collective and a way to read records
into one message (see docs/diagnostics.md)::

    rank 2: all_reduce #55 of the tp group (global ranks [2, 3]) did not complete (...)
      it was called at hybrid/tensor_parallel/mappings.py:123 in forward (via ...)
      rank 3 never reached it; all got through #54, all_reduce at ...
      rank 3: no heartbeat for 4.6 s (...); its last one had it ...
      stuck: rank 3.

or, when every rank of a host went silent::

      node node1 (ranks 2, 3) lost: no heartbeat from any of its ranks since the failure (...)
        rank 2: last seen 3.1 s ago, getting through all_gather #11 of the world group ...

It also words the ``--check-collectives`` mismatch (:func:`mismatch_message`).
"""

from __future__ import annotations

import re
import time

# the source location gloo/nccl put in front of their messages
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def short_error(detail: str) -> str:
    """The backend's own words, without its C++ source location, on one line."""
    text = _SOURCE_PREFIX.sub("", " ".join(str(detail).split()))
    return text[:300]


def rank_list(ranks) -> str:
    """'rank 3', 'ranks 0-2', 'ranks 0, 2, 5-7'."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j == i else
                     f"{ranks[i]}, {ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def describe(e: dict) -> str:
    """'all_reduce #57 of the tp group (global ranks [2, 3])'."""
    return f"{e['op']} #{e['seq']} of the {e['group']} group (global ranks {e['ranks']})"


def shape_str(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


# [Note: a stuck exchange]
# A point-to-point exchange (CommGroup.exchange: a pipeline's activations and gradients)
# is met by its other end alone, the global ranks its entry names as ``peers``; the other
# ranks of the group never join it, and each rank numbers its exchanges by what its own
# list holds. So the numbers say nothing of who reached it: the report reads the other
# end's record instead and says where that rank is (blocked in an exchange of its own,
# which is followed the same way, or alive elsewhere, silent, or gone). A pipeline's
# exchange also says what it is in words (``about``: the stage, the action, the
# micro-batch), and the report and every pointer lead with them.
def subject(e: dict) -> str:
    """How a report or a pointer names a failing collective: :func:`describe`, or for a
    pipeline's exchange 'pipeline stuck at RA3.s1<0, receiving stage 1's input for
    micro-batch 3 from stage 0 (global rank 0): p2p #5 of the pp group (global ranks
    [0, 1])'."""
    if not e.get("about"):
        return describe(e)
    return (f"pipeline stuck at {e['op']}, {e['about']}: p2p #{e['seq']} of the {e['group']} "
            f"group (global ranks {e['ranks']})")


def headline(rank: int, e: dict, timeout_s: float, detail: str) -> str:
    return (f"rank {rank}: {subject(e)} did not complete (timeout {timeout_s:g} s; "
            f"{short_error(detail)})\n  it was called at {e['caller']} on a "
            f"{shape_str(e['shape'])} {e['dtype']} tensor")


def is_fresh(rec: dict) -> bool:
    """Written after some rank raised the alarm, by a rank that failed itself, or by one
    that left: nothing newer will come."""
    return bool(rec.get("alarm")) or rec.get("failed") is not None or bool(rec.get("closed"))


def _last_collective(rec: dict) -> dict | None:
    lasts = [g["last"] for g in rec["groups"].values() if g.get("last")]
    return max(lasts, key=lambda e: e["t"]) if lasts else None


def _where_now(rec: dict, now: float) -> str:
    """Where a rank outside any collective is, from its fresh record."""
    at = f"at {rec['where']}" if rec.get("where") else "at an unknown line"
    return (f"it is alive (heartbeat {max(0.0, now - rec['t']):.1f} s ago) and {at}, "
            f"with {_idle(rec, now)}")


def _doing(rec: dict) -> str:
    """What a record says its rank was doing when it was written."""
    blocked = rec.get("waiting")
    g = rec["groups"].get(blocked["group"]) if blocked else None
    if blocked and g and g.get("last") and g["last"]["seq"] == blocked["seq"]:
        return f"blocked in {describe(dict(g['last'], ranks=g['ranks']))}"
    return (f"at {rec['where']}" if rec.get("where") else "at an unknown line") + \
        f" with {_idle(rec, rec['t'])}"


def _silent(rec: dict, now: float) -> str:
    """What a rank that stopped publishing last said: it may be frozen mid-step."""
    return (f"no heartbeat for {max(0.0, now - rec['t']):.1f} s (the process is stopped, "
            f"dead, or hung holding the Python interpreter); its last one had it "
            f"{_doing(rec)}")


def _idle(rec: dict, now: float) -> str:
    last = _last_collective(rec)
    if last is None:
        return "no collective since it started"
    return (f"no collective for {max(0.0, now - last['t']):.1f} s (the last: {describe(last)} "
            f"at {last['caller']})")


def own_view(rec: dict) -> str:
    """What one rank can say alone: its last collective per group."""
    lines = []
    for name, g in rec["groups"].items():
        if g.get("last"):
            lines.append(f"\n  this rank's last {name} collective: {describe(g['last'])} at "
                         f"{g['last']['caller']}")
    return "".join(lines)


def explain(head: str, failing: dict, own: dict, read_group, dump_dir: str | None,
            now: float | None = None, host_ranks=None) -> str:
    """The report of the failing collective ``failing`` (an entry dict).

    ``read_group(ranks) -> {rank: record}`` reads the records of a group's
    ranks (missing ones: no record). A rank that never reached collective #k
    of a group and is itself blocked in another group's collective leads to
    that group, once per group, so the report names the ranks stuck outside
    any collective.

    A silent rank (no fresh record: dead, stopped or hung) is shown where it was
    last seen: its own last record, or a later collective its peers completed
    with it (:func:`_seen_later`). ``host_ranks(host) -> [rank]`` (None: unknown)
    names the ranks of a host; when none of them answered, the host is named
    once as a lost node, with all its ranks, those outside the failing groups too.
    """
    lines = [head]
    me = own["rank"]
    known = {me: own}  # every record read: what peers know of a silent rank

    def read(ranks):
        recs = read_group(ranks)
        known.update(recs)
        return recs

    # (collective some rank is blocked in, line that names it, that rank)
    frontier = [(failing, 0, me)]
    seen = {_followed(failing, me)}
    stuck, left = [], []
    silent = {}  # rank -> (index of the line worded for it below, its record)
    while frontier:
        e, at, who = frontier.pop(0)
        if e.get("peers") is not None:  # [Note: a stuck exchange]
            missing = [r for r in e["peers"] if r != me]
            recs = read(missing) if missing else {}
            said = f"\n  its other end is {rank_list(e['peers'])}"
            if me in e["peers"] and who != me:
                said += (f", this rank, blocked in the exchange above: rank {who} and this "
                         f"rank wait for each other")
            lines[at] += said + "."
        else:
            recs = read(e["ranks"])
            missing = [r for r in e["ranks"] if r not in recs
                       or recs[r]["groups"].get(e["group"], {}).get("seq", 0) < e["seq"]]
            if not missing:
                lines[at] += ("\n    every rank of the group reached it: the backend failed, "
                              "not a lagging rank")
                continue
            said = f"\n  {rank_list(missing)} never reached it"
            prev = _prev_entry(e, recs, own) if e["op"] != "broadcast" else None
            if prev is not None:  # #k-1 completed where #k is waited for: every rank issued it
                said += f"; all got through #{prev['seq']}, {prev['op']} at {prev['caller']}"
            lines[at] += said + "."
        clock = time.time() if now is None else now
        for r in missing:
            rec = recs.get(r)
            if rec is None:
                lines.append(f"  rank {r}: published no record (it may have died before its "
                             f"first collective).")
                stuck.append(r)
                continue
            if rec.get("closed"):  # it returned from its work: it skipped collectives
                lines.append(f"  rank {r}: it finished and left the job, with "
                             f"{_idle(rec, clock)}.")
                left.append(r)
                continue
            if not is_fresh(rec):  # it stopped publishing: worded once every group is read
                if r not in silent:
                    lines.append("")
                    silent[r] = (len(lines) - 1, rec)
                    stuck.append(r)
                continue
            blocked = rec.get("waiting") or rec.get("failed")
            g = rec["groups"].get(blocked["group"]) if blocked else None
            if g and g.get("last") and g["last"]["seq"] == blocked["seq"]:
                nxt = dict(g["last"], ranks=g["ranks"])
                since = (f" for {clock - blocked['since']:.1f} s"
                         if blocked.get("since") else "")
                state = "failed in" if rec.get("failed") else "is blocked in"
                lines.append(f"  rank {r} {state} {subject(nxt)} at {nxt['caller']}{since}.")
                key = _followed(nxt, r)
                if key not in seen:
                    seen.add(key)
                    frontier.append((nxt, len(lines) - 1, r))
                continue
            lines.append(f"  rank {r}: {_where_now(rec, clock)}.")
            stuck.append(r)
    clock = time.time() if now is None else now
    nodes = _lost_nodes(silent, read, host_ranks)
    in_node = {r for _, ranks, _ in nodes for r in ranks}
    dropped: set[int] = set()  # the lines of ranks a lost node's one line speaks for
    for r, (at, rec) in silent.items():
        if r not in in_node:
            later = _seen_later(r, rec, known, read, clock)
            lines[at] = f"  rank {r}: {_silent(rec, clock)}{later}."
    for host, ranks, recs in nodes:
        first = min((silent[r][0] for r in ranks if r in silent), default=None)
        text = (f"  node {host} ({rank_list(ranks)}) lost: no heartbeat from any of its ranks "
                f"since the failure (the processes died or are stopped, or the host is "
                f"unreachable).")
        text += "".join(f"\n    rank {r}: {_last_seen(r, recs[r], known, read, clock)}."
                        for r in ranks)
        dropped.update(silent[r][0] for r in ranks if r in silent)
        if first is None:
            lines.append(text)
        else:
            lines[first] = text
            dropped.discard(first)
    lines = [ln for i, ln in enumerate(lines) if i not in dropped]
    stuck = [r for r in stuck if r not in in_node]
    if stuck:
        lines.append(f"  stuck: {rank_list(stuck)}.")
    if left:
        lines.append(f"  left early: {rank_list(left)}.")
    for host, ranks, _ in nodes:
        lines.append(f"  lost: node {host} ({rank_list(ranks)}).")
    if dump_dir:
        lines.append(f"  each live rank's last collectives: {dump_dir}/collectives_rank*.json")
    return "\n".join(lines)


def _followed(e: dict, rank: int) -> tuple:
    """What the report follows once: a group's collective, or one rank's exchange (each
    rank of a pipeline waits in an exchange of its own)."""
    if e.get("peers") is not None:
        return (e["group"], tuple(e["ranks"]), rank)
    return (e["group"], tuple(e["ranks"]))


def _lost_nodes(silent: dict, read, host_ranks) -> list[tuple[str, list[int], dict]]:
    """(host, its ranks, their records) for each host of a silent rank none of whose
    ranks answered: reads the host's other ranks, O(ranks per host)."""
    if host_ranks is None:
        return []
    by_host: dict = {}
    for r, (_, rec) in silent.items():
        if rec.get("host"):
            by_host.setdefault(rec["host"], []).append(r)
    out = []
    for host, ranks in by_host.items():
        on_host = host_ranks(host)
        if not on_host or not set(ranks) <= set(on_host):
            continue
        recs = {r: silent[r][1] for r in ranks}
        others = [r for r in on_host if r not in recs]
        recs.update(read(others) if others else {})
        if all(r in recs and not is_fresh(recs[r]) for r in on_host):
            out.append((host, sorted(on_host), recs))
    return out


# Collectives whose completion on one rank does not need every rank's part (a broadcast
# needs the root's, a ring exchange the previous rank's): they say nothing of the others.
_PARTIAL = ("broadcast", "ring_exchange")


def _later_collective(r: int, rec: dict, known: dict, read) -> dict | None:
    """The newest collective of ``r``'s groups that one of its peers completed, later than
    ``r``'s own record shows (it needed ``r``'s part, so ``r`` got through it); None if its
    record is as new. Reads one peer of a group no record read so far is in."""
    found = []
    for name, g in rec["groups"].items():
        if not _peers(r, name, g["ranks"], known):
            others = [m for m in g["ranks"] if m != r and m not in known]
            if others:
                read(others[:1])
        for m in _peers(r, name, g["ranks"], known):
            pg = known[m]["groups"][name]
            for x in (pg.get("last"), pg.get("prev")):
                # (an exchange counts only if it received from r: a completed send
                # proves nothing of its receiver)
                if (x and x.get("state") == "done" and x["op"] not in _PARTIAL
                        and x["seq"] > g["seq"] and ("peers" not in x or r in x.get("heard", ()))):
                    found.append(dict(x, ranks=g["ranks"]))
    return max(found, key=lambda x: (x["t"], x["seq"])) if found else None


def _peers(r: int, group: str, ranks: list[int], known: dict) -> list[int]:
    """The ranks other than ``r`` whose records read so far are of the same group."""
    return [m for m, rec in known.items()
            if m != r and rec["groups"].get(group, {}).get("ranks") == ranks]


def _seen_later(r: int, rec: dict, known: dict, read, now: float) -> str:
    """'; its peers saw it later, getting through ...' where they know of a later
    collective than its own last record, else ''."""
    later = _later_collective(r, rec, known, read)
    if later is None:
        return ""
    return (f"; its peers saw it later, getting through {describe(later)} at "
            f"{later['caller']}, {max(0.0, now - later['t']):.1f} s ago")


def _last_seen(r: int, rec: dict, known: dict, read, now: float) -> str:
    """Where a silent rank was last seen: a collective its peers completed with it, or its
    own last record, whichever is later."""
    later = _later_collective(r, rec, known, read)
    if later is not None:
        return (f"last seen {max(0.0, now - later['t']):.1f} s ago, getting through "
                f"{describe(later)} at {later['caller']}")
    return (f"last heard from {max(0.0, now - rec['t']):.1f} s ago, {_doing(rec)}")


def _prev_entry(e: dict, recs: dict, own: dict) -> dict | None:
    """Collective #k-1 of ``e``'s group as a rank that reached #k issued it."""
    for rec in [own, *recs.values()]:
        g = rec["groups"].get(e["group"])
        if not g or g["ranks"] != e["ranks"]:
            continue
        for cand in (g.get("last"), g.get("prev")):
            if cand and cand["seq"] == e["seq"] - 1:
                return cand
    return None


def mismatch_message(group: str, ranks: list[int], rows: list[dict]) -> str:
    """The --check-collectives report: the odd ranks' call against the majority's.

    ``rows[i]``: what group rank ``i`` (global rank ``ranks[i]``) is calling:
    op, seq, shape, dtype, extra (root or reduction), caller.
    """
    classes: dict = {}
    for r, row in zip(ranks, rows):
        classes.setdefault(_key(row), []).append(r)
    ordered = sorted(classes.values(), key=lambda rs: (-len(rs), rs[0]))
    major = ordered[0]
    ref = rows[ranks.index(major[0])]
    parts = []
    for odd in ordered[1:]:
        row = rows[ranks.index(odd[0])]
        verb = "calls" if len(odd) == 1 else "call"
        parts.append(f"{rank_list(odd)} {verb} {_call(row)} where {rank_list(major)} "
                     f"{'calls' if len(major) == 1 else 'call'} {_call(ref)}")
    return (f"collective mismatch in the {group} group (global ranks {ranks}): "
            + "; ".join(parts))


def _key(row: dict) -> tuple:
    return (row["op"], row["seq"], tuple(row["shape"]), row["dtype"], row["extra"],
            row["caller"])


def _call(row: dict) -> str:
    shape = shape_str(row["shape"])
    extra = f" {row['extra_name']}" if row.get("extra_name") else ""
    return f"{row['op']} #{row['seq']} {shape} {row['dtype']}{extra} at {row['caller']}"
