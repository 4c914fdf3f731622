"""``--check-replicas-interval N``: replicated parameters are checked bit-identical.

Two kinds of parameters are held in full by several ranks, and training keeps
the copies equal to the bit (same data, same reductions, same updates):

* over the TP group, the parameters TP does not split: LayerNorm weights and
  biases, row-parallel biases, the position embedding. At ZeRO-3 a partitioned
  unit has the same layout on every TP rank, so this rank's shard of such a
  parameter is compared with the same shard on its TP peers;
* over the DP group (DP x CP with context parallelism: ZeRO's group), every
  parameter ZeRO keeps whole: all of them at stages 0-2, the small persistent
  ones at stage 3.

Under ``--offload-param`` a partitioned unit's shard lives in its home (host
memory or the rank's params.swp) between gathers: the check reads it from
there, one unit at a time, so a check holds at most one unit's shard.

A copy that drifted (a missed reduction, a rank-dependent code path, a flipped
bit) trains on silently. The check sums each parameter's raw bits -- the
plain sum and a position-weighted sum of its elements read as integers, both
exact in int64 -- and compares them with one all-reduce (MAX of the sums and
of their negations) per group: O(parameters) int64 per rank, whatever the
group size, one collective per group per check. Only when some parameter
differs, one all-gather of the first few differing sums names the ranks, and
every rank stops with the same message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybrid.diagnostics.report import rank_list
from hybrid.errors import TrainingError
from hybrid.tensor_parallel import is_tp_split

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NAMED = 4  # differing parameters named per group
_MESSAGE_BYTES = 4096


class ReplicaChecker:
    """Checksums of the replicated parameters of ``model`` under ``engine``'s layout."""

    def __init__(self, model, engine, ps) -> None:
        self.ps = ps
        names = {id(p): n for n, p in model.named_parameters()}
        shards: dict = {}  # unit index -> its owned pieces of TP-replicated params
        for pc in engine.owned_pieces():
            if not is_tp_split(pc.param):
                shards.setdefault(pc.unit, []).append(pc)
        # (name, () -> tensor of this rank's copy)
        self.tp: list[tuple[str, Callable[[], torch.Tensor]]] = []
        self.dp: list[tuple[str, Callable[[], torch.Tensor]]] = []
        for k, u in enumerate(engine.units):
            if u.partition_params:  # stage 3: this rank's shard of each TP-replicated param
                self.tp += [(pc.name, functools.partial(self._piece, u, pc.part))
                            for pc in shards.get(k, [])]
                continue
            for p in u.params:
                if not is_tp_split(p):
                    self.tp.append((names[id(p)], p.detach))
                self.dp.append((names[id(p)], p.detach))
        self._weights = torch.empty(0, dtype=torch.int64, device=ps.device)
        # (unit, its shard values): the pieces come unit by unit
        self._last: tuple[object, torch.Tensor] | None = None

    def _piece(self, u, part: slice) -> torch.Tensor:
        """Piece ``part`` of ``u``'s shard values."""
        return self._shard_of(u)[part]

    def _shard_of(self, u) -> torch.Tensor:
        """``u``'s shard values, wherever they live (read once for all its pieces)."""
        if self._last is None or self._last[0] is not u:
            self._last = (u, u.shard_values())
        return self._last[1]

    def _checksums(self, items) -> torch.Tensor:
        """``(2 * len(items),)`` int64: per item, the sum and the position-weighted sum of
        its elements' bits as integers (exact, wrapping modulo 2**64)."""
        out = torch.zeros(2 * len(items), dtype=torch.int64, device=self.ps.device)
        for k, (_, get) in enumerate(items):
            t = get().reshape(-1).to(self.ps.device)  # (an offloaded shard: from the host)
            x = t.view(_INT[t.element_size()]).to(torch.int64)
            if self._weights.numel() < x.numel():
                self._weights = torch.arange(x.numel(), device=x.device) % 65521 + 1
            out[2 * k] = x.sum()
            out[2 * k + 1] = (x * self._weights[: x.numel()]).sum()
        self._last = None  # (no shard kept between checks)
        return out

    @torch.no_grad()
    def check(self, iteration: int) -> None:
        """Compare every replica over its group; raise TrainingError on every rank if any
        differs. Collective over the TP group, the DP (x CP) group and the world."""
        ps = self.ps
        found = []
        for group, kind, items in ((ps.tp_group, "TP-replicated", self.tp),
                                   (ps.dp_cp_group, "DP-replicated", self.dp)):
            if group.size == 1 or not items:
                continue
            mine = self._checksums(items)
            both = torch.cat([mine, -mine])
            group.all_reduce(both, op=dist.ReduceOp.MAX)
            n = len(items)
            differ = (both[: 2 * n] != -both[2 * n:]).view(n, 2).any(1).nonzero().flatten()
            if differ.numel():
                found.append(self._name_ranks(group, kind, items, mine, differ.tolist()))
        self._stop_together(found, iteration)

    def _name_ranks(self, group, kind: str, items, mine: torch.Tensor, differ: list[int]) -> str:
        """Which ranks hold which copy of the first differing parameters (one all-gather,
        only when something differs)."""
        idx = torch.tensor(differ[:_NAMED], device=mine.device)
        sums = mine.view(-1, 2)[idx].reshape(-1)
        every = torch.empty(group.size * sums.numel(), dtype=torch.int64, device=mine.device)
        group.all_gather(every, sums)
        every = every.view(group.size, -1, 2).cpu()
        parts = []
        for j, k in enumerate(differ[:_NAMED]):
            copies: dict = {}
            for gr, r in enumerate(group.ranks):
                copies.setdefault(tuple(every[gr, j].tolist()), []).append(r)
            held = sorted(copies.values(), key=lambda rs: (-len(rs), rs[0]))
            if len(held[0]) > len(held[1]):
                who = "; ".join(f"{rank_list(rs)} {'differs' if len(rs) == 1 else 'differ'} "
                                f"from {rank_list(held[0])}" for rs in held[1:])
            else:
                who = " / ".join(rank_list(rs) for rs in held) + " hold different values"
            parts.append(f"{items[k][0]} ({who})")
        return (f"{len(differ)} of {len(items)} {kind} parameters differ across the "
                f"{group.name} group (global ranks {group.ranks}): " + ", ".join(parts))

    def _stop_together(self, found: list[str], iteration: int) -> None:
        """Every rank learns whether any group diverged (one world all-reduce); the rank
        that saw the most broadcasts its message and all raise it."""
        ps = self.ps
        W = ps.world_size
        key = torch.tensor([len(found) * W + (W - 1 - ps.rank) if found else -1],
                           dtype=torch.int64, device=ps.device)
        ps.world_group.all_reduce(key, op=dist.ReduceOp.MAX)
        top = int(key.item())
        if top < 0:
            return
        src = W - 1 - top % W
        buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=ps.device)
        if ps.rank == src:
            raw = ("; ".join(found)).encode()[: _MESSAGE_BYTES]
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(ps.device)
        ps.world_group.broadcast(buf, src=src)
        text = bytes(buf.cpu().numpy()).rstrip(b"\0").decode(errors="replace")
        raise TrainingError(f"replica check at iteration {iteration} (--check-replicas-interval): "
                            f"{text}. The copies diverged since the last check; stopping "
                            f"without saving")
