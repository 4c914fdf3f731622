"""``--check-collectives``: the ranks of a group agree on a collective before running it.

Before each collective every rank of the group all-gathers a fixed-size int64
fingerprint of what it is about to call -- sequence number, op, shape, dtype,
root or reduction, a hash of its call site (file:line of the caller and of the
two callers above it in other files), and the call site itself as bytes -- one
small all-gather (:data:`WIDTH` int64 per rank) over the same group. Ranks that
disagree stop before the real collective runs, with a message naming both
calls::

    collective mismatch in the world group (global ranks [0, 1, 2, 3]): rank 3
    calls all_gather #2 (8,) float32 at X:12 where ranks 0-2 call all_reduce #2
    (8,) float32 sum at Y:40

The call site is compared too: every collective in hybrid is called from the
same lines on every rank of its group (SPMD), so a rank that skipped one shows
up at the very next collective, calling it from another line, even when op
and shape happen to match. Paths are relative to the repository root, so
nodes with the checkout in different directories agree.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from hybrid.diagnostics.entry import Entry, short_path
from hybrid.diagnostics.report import mismatch_message

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "ring_exchange",
       "all_to_all_v")
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
           "uint8", "bool")
_REDUCE = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "product",
           dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max"}
_REDUCE_CODE = {k: i + 1 for i, k in enumerate(_REDUCE)}
_REDUCE_NAME = {i + 1: v for i, v in enumerate(_REDUCE.values())}
# torch 2.13 renamed the tensor-in/tensor-out all-gather (as in hybrid/parallel/comm.py)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_HEAD = 11  # seq, op, dtype, ndim, 4 dims, extra, numel, call-site hash: compared
CALLER_BYTES = 192
WIDTH = _HEAD + CALLER_BYTES // 8


def extra_code(op: str, reduce_op=None, src: int | None = None) -> int:
    """What else must agree: the reduction of a reduce, the root of a broadcast."""
    if op == "broadcast":
        return 1000 + int(src or 0)
    if reduce_op is not None:
        return _REDUCE_CODE.get(reduce_op, 99)
    return 0


def encode(e: Entry, extra: int, numel: int, device) -> torch.Tensor:
    """``(WIDTH,)`` int64 fingerprint of collective ``e``."""
    shape = list(e.shape)
    if len(shape) > 4:  # fold trailing dims: the count is what a mismatch shows
        tail = 1
        for d in shape[3:]:
            tail *= d
        shape = shape[:3] + [tail]
    caller = call_site(e.frames)
    head = [e.seq, OPS.index(e.op), _DTYPES.index(e.dtype) if e.dtype in _DTYPES else 99,
            len(e.shape)] + shape + [-1] * (4 - len(shape)) + [extra, numel,
                                                               zlib.crc32(caller.encode())]
    raw = caller.encode()[:CALLER_BYTES].ljust(CALLER_BYTES, b"\0")
    name = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    return torch.cat([torch.tensor(head, dtype=torch.int64), name]).to(device)


def call_site(frames) -> str:
    """'X:12 (via Y:40, Z:7)': file:line of the caller and its callers in other files."""
    if not frames:
        return "?"
    where = [f"{short_path(f)}:{line}" for f, line, _ in frames]
    return where[0] + (f" (via {', '.join(where[1:])})" if len(where) > 1 else "")


def decode(row: torch.Tensor) -> dict:
    v = row.tolist()
    ndim = v[3]
    shape = [d for d in v[4:8] if d >= 0][:ndim] if ndim <= 4 else v[4:8]
    extra = v[8]
    raw = row[_HEAD:].numpy().tobytes().rstrip(b"\0")
    return {"seq": v[0], "op": OPS[v[1]],
            "dtype": _DTYPES[v[2]] if v[2] < len(_DTYPES) else "?",
            "shape": shape, "extra": extra,
            "extra_name": (f"from group rank {extra - 1000}" if extra >= 1000
                           else _REDUCE_NAME.get(extra, "")),
            "caller": raw.decode(errors="replace")}


def check(group, e: Entry, extra: int, numel: int, device) -> str | None:
    """All-gather ``e``'s fingerprint over ``group``; the mismatch message, or None.

    Raises what the backend raises (a timeout: a rank never got here).
    """
    mine = encode(e, extra, numel, device)
    out = torch.empty(group.size * WIDTH, dtype=torch.int64, device=device)
    _all_gather_single(out, mine, group=group.pg)
    rows = out.view(group.size, WIDTH).cpu()
    if bool((rows[:, :_HEAD] == rows[0, :_HEAD]).all()):
        return None
    return mismatch_message(group.name, group.ranks, [decode(r) for r in rows])
