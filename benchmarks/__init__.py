"""Benchmarks that are more than one file: each package here is driven by a script in
``scripts/`` (``peers``: ``scripts/bench_peers.py``). Nothing in ``hybrid`` imports them."""
