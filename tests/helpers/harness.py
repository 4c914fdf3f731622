"""The multi-rank test harness: ``run_ranks(fn, world_size, tp, args)``.

It lives in the library (:mod:`hybrid.testing.pool`) so benchmark scripts use the
same launcher; tests import it from here.
"""

from hybrid.testing.pool import run_ranks

__all__ = ["run_ranks"]
