"""Parts of a model that separate backwards reach: an interleaved pipeline rank's chunks.

A pipeline rank that holds several model chunks (virtual stages r, r + p, ...)
runs one backward per chunk and micro-batch, and each reaches only its chunk's
parameters. The engine is told the model's parts (``apply_zero(..., parts=...)``,
one list of parameters per chunk) and each backward's part
(:meth:`~hybrid.zero.ZeroEngine.begin_backward` ``(sync, part=c)``), and keeps
three rules:

* no unit holds two parts' parameters: :func:`split_by_part` cuts each unit the
  plan made across parts (a gradient bucket, stage 3's persistent buckets or its
  root unit) into one unit per part, and leaves every other unit as it is;
* a backward of part c expects gradients for c's units, all of them, and for no
  other unit (the reducer checks both);
* ``sync`` is the part's own: stages 0-1 reduce a unit at the last backward of
  its part in the step, stages 2-3 hand its shard on as final there. So every
  unit is still reduced once a step at stages 0-1, as without parts, and an
  offloaded optimizer's gradient goes down as soon as its part is done.

Without parts the engine has one, holding every unit: PP 1 and one chunk per
rank run exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hybrid.zero.flat_unit import FlatUnit


def split_by_part(units: list[FlatUnit], owners: list[tuple[nn.Module, FlatUnit]],
                  parts: Sequence[Sequence[nn.Parameter]]
                  ) -> tuple[list[FlatUnit], list[tuple[nn.Module, FlatUnit]], list[int]]:
    """(units, owners, the part of each unit): ``units`` and stage 3's ``owners`` with
    every unit that holds several parts' parameters replaced, in place, by one unit per
    part (its parameters in their order, the same flags; named ``<name>.p<k>``), each
    owned by the same module. ``parts``: disjoint lists of the model's parameters; a
    ValueError names a unit's parameter that is in none (its gradient would come from
    no backward the engine is told of)."""
    part_of = {id(p): k for k, ps in enumerate(parts) for p in ps}
    if len(part_of) != sum(len(ps) for ps in parts):
        raise ValueError("a parameter is in two parts of the model: each backward must "
                         "reach its own parameters")
    pieces: dict[int, list[FlatUnit]] = {}  # id of a unit cut in parts -> its pieces
    out: list[FlatUnit] = []
    where: list[int] = []
    for u in units:
        missing = [i for i, p in enumerate(u.params) if id(p) not in part_of]
        if missing:
            raise ValueError(f"ZeRO unit {u.name!r} holds a parameter in none of the model's "
                             f"{len(parts)} parts (parameter {missing[0]} of the unit)")
        ks = [part_of[id(p)] for p in u.params]
        order = list(dict.fromkeys(ks))  # the unit's parts, by first appearance
        if len(order) == 1:
            out.append(u)
            where.append(order[0])
            continue
        owns_all = u.own_lo == 0 and u.own_hi == u.padded  # (stage 0's units)
        cut = [FlatUnit([p for p, k in zip(u.params, ks) if k == part], u.dp,
                        partition_params=u.partition_params, owns_all=owns_all,
                        deferred=u.deferred, name=f"{u.name}.p{part}") for part in order]
        pieces[id(u)] = cut
        out += cut
        where += order
    owned = [(m, piece) for m, u in owners for piece in pieces.get(id(u), [u])]
    return out, owned, where
