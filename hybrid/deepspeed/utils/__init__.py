"""``deepspeed.utils``: the one helper DeepSpeed's pipeline scripts take from it.

``RepeatingLoader(loader)`` starts ``loader`` again at its end, for
``engine.train_batch(data_iter=RepeatingLoader(...))`` (DeepSpeedExamples'
pipeline scripts). DeepSpeed's other helpers here (its logger, the ``safe_get_*``
accessors of partitioned state, the groups) are not served: an AttributeError says so.
"""

from __future__ import annotations

from typing import NoReturn

from hybrid.deepspeed.pipe_engine import RepeatingLoader

__all__ = ["RepeatingLoader"]


def __getattr__(name: str) -> NoReturn:
    raise AttributeError(f"hybrid.deepspeed.utils has no {name!r} (DeepSpeed's "
                         f"deepspeed.utils.{name}): it holds RepeatingLoader only; read a "
                         f"parameter or its gradient inside zero.GatheredParameters")
