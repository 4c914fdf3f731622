"""The multi-rank test harness: ``run_ranks(fn, world_size, tp, args)``.

It lives in the library (:mod:`hybrid.multiprocess`) so benchmark scripts use the
same launcher; tests import it from here.
"""

from hybrid.multiprocess import run_ranks

__all__ = ["run_ranks"]
