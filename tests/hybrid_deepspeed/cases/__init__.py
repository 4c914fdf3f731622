"""DeepSpeed-style training scripts, each run twice with only the ``deepspeed`` module
changed: under DeepSpeed itself (``tests/hybrid_deepspeed/record_deepspeed.py`` records their
numbers into ``tests/hybrid_deepspeed/recorded/``) and under ``hybrid.deepspeed``
(``tests/hybrid_deepspeed/test_against_deepspeed.py`` compares with the recording).

:data:`CASES` maps each case's name to its :class:`~tests.hybrid_deepspeed.cases.common.Case`
(the contract of a case, its result and its data: :mod:`tests.hybrid_deepspeed.cases.common`).
The scripts, by what they cover:

- :mod:`.zero`: ZeRO stages 1-3, host offload (optimizer; parameters and optimizer),
  gradient accumulation, clipping, parameters the loss does not reach and a tied head;
- :mod:`.schedules`: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest,
  and a ``transformers`` schedule as a client ``lr_scheduler``;
- :mod:`.optimizers`: a client AdamW, a client SGD with momentum, frozen parameters,
  no-decay groups, the config's weight decay on every parameter;
- :mod:`.usage`: ``training_data=``, a plain ``loss.backward()``, a string-tag
  checkpoint with a tensor in ``client_state``, ``zero.Init`` with constructor init;
- :mod:`.pipe`: ``deepspeed.pipe``'s ``PipelineModule`` at 2 stages, ``train_batch``,
  ``eval_batch``, a ``TiedLayerSpec`` on the first and the last stage, ``seed_layers``,
  activation checkpointing, a pipeline checkpoint resumed.
"""

from __future__ import annotations

import os
import traceback

from tests.hybrid_deepspeed.cases import optimizers, pipe, schedules, usage, zero
from tests.hybrid_deepspeed.cases.common import CASES, Case, Result

__all__ = ["CASES", "Case", "Result", "on_ranks", "run_cases"]

# The modules register their cases as they are imported (alphabetically); the registry
# is put in the order listed above, which the recorder and the tests' ids follow.
_MODULES = (zero, schedules, optimizers, usage, pipe)
_ordered = sorted(CASES.items(),
                  key=lambda item: [m.__name__ for m in _MODULES].index(item[1].run.__module__))
CASES.clear()
CASES.update(_ordered)


def run_cases(deepspeed, names, workdir: str) -> dict[str, Result]:
    """Run the cases ``names`` one after another on this rank with ``deepspeed``, each
    in its own directory under ``workdir`` (the same path on every rank). A case that
    raises gives ``{"error": "Type: message", "error_type": "Type", "traceback": ...}``
    instead of its result, and the next case runs: a refusal raised alike on every
    rank (at ``initialize``) leaves no collective unmatched."""
    deepspeed.init_distributed(dist_backend="gloo")  # a script's first line; joined: a no-op
    out: dict[str, Result] = {}
    for name in names:
        path = os.path.join(workdir, name)
        os.makedirs(path, exist_ok=True)
        try:
            out[name] = CASES[name](deepspeed, path)
        except Exception as e:  # reported per case, by the caller
            out[name] = {"error": f"{type(e).__name__}: {e}", "error_type": type(e).__name__,
                         "traceback": traceback.format_exc()}
    return out


class _OnRanks:
    """``hybrid.deepspeed`` on the pooled ranks of a test: the module itself, except
    that ``initialize`` gets the ranks' :class:`ParallelState` as ``mpu`` (unless the
    script passes one), and so does ``pipe.PipelineModule`` as ``parallel_state`` (the
    pipeline cases run on ranks laid out PP x DP). Under torchrun hybrid builds that
    layout from the environment (or the process group); the pooled ranks joined their
    process group before the call and hand it over instead of building a second set of
    groups per engine."""

    def __init__(self, module, ps):
        self._module, self._ps = module, ps
        self.pipe = _PipeOnRanks(module.pipe, ps)

    def initialize(self, *args, **kwargs):
        kwargs.setdefault("mpu", self._ps)
        return self._module.initialize(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


class _PipeOnRanks:
    """``hybrid.deepspeed.pipe`` whose ``PipelineModule`` takes the pooled ranks' layout."""

    def __init__(self, module, ps):
        self._module, self._ps = module, ps

    def PipelineModule(self, *args, **kwargs):  # noqa: N802 (DeepSpeed's class name)
        kwargs.setdefault("parallel_state", self._ps)
        return self._module.PipelineModule(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


def on_ranks(ps, names, workdir: str) -> dict[str, Result]:
    """:func:`run_cases` under ``hybrid.deepspeed`` on a pooled rank (``run_ranks``)."""
    import hybrid.deepspeed
    return run_cases(_OnRanks(hybrid.deepspeed, ps), names, workdir)
