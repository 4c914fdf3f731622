"""Medians, ratios and rounding over possibly missing values, ABBA order, and the record
of one measure for a pair of sides."""

from __future__ import annotations

import statistics


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def rnd(x, nd=5):
    return None if x is None else round(x, nd)


def abba(p: int, first: str, second: str) -> list[str]:
    """The order of pair ``p``: (first, second) for even ``p``, (second, first) for odd."""
    return [first, second] if p % 2 == 0 else [second, first]


def pair_record(h: list, peer: list, peer_name: str, nd: int = 5) -> dict:
    """One measure of hybrid (``h``) and a peer, run by run: both medians and the
    median of the per-pair ratios hybrid / peer, with those ratios."""
    pair = [ratio(x, y) for x, y in zip(h, peer)]
    return {"hybrid_median_s": rnd(median(h), nd), f"{peer_name}_median_s": rnd(median(peer), nd),
            "ratio": rnd(median(pair), 4), "pair_ratios": [rnd(x, 4) for x in pair]}
