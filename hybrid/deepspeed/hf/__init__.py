"""Hugging Face's Trainer on hybrid's engine: the one change to a Trainer script is its import.

    from hybrid.deepspeed.hf import Trainer, TrainingArguments   # was: from transformers import ...
    args = TrainingArguments(output_dir="out", deepspeed="ds_config.json", ...)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=dev)
    trainer.train()
    trainer.evaluate()

``TrainingArguments(deepspeed=...)`` (:mod:`.arguments`) keeps the config from
accelerate's DeepSpeed plugin (no DeepSpeed install is needed) and fills its ``"auto"``
values as transformers does (:mod:`.auto`); the :class:`Trainer` (:mod:`.trainer`)
builds hybrid's engine with :func:`hybrid.deepspeed.initialize` when training starts
and routes the loop's backward, optimizer and scheduler steps, clipping, saving,
loading and evaluation to it. docs/deepspeed.md ("Hugging Face's Trainer") says what
is served and what is not. Run it as any Trainer script: ``torchrun --nproc-per-node N
script.py``.

The two classes are imported on first use, so :mod:`.auto` (the ``"auto"`` rules)
imports without transformers.

* :mod:`.arguments` ``TrainingArguments`` whose ``deepspeed=`` hybrid's engine reads, not DeepSpeed
* :mod:`.auto`      Hugging Face's ``"auto"`` in a ds_config, filled from the arguments and the run
* :mod:`.trainer`   transformers' ``Trainer`` with hybrid's engine where DeepSpeed's would be
* :mod:`.stepped`   the optimizer and scheduler a Trainer's loop holds when hybrid's engine trains
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybrid.deepspeed.hf.arguments import TrainingArguments
    from hybrid.deepspeed.hf.trainer import Trainer

__all__ = ["Trainer", "TrainingArguments"]


def __getattr__(name: str) -> type[TrainingArguments] | type[Trainer]:
    if name == "TrainingArguments":
        from hybrid.deepspeed.hf.arguments import TrainingArguments
        return TrainingArguments
    if name == "Trainer":
        from hybrid.deepspeed.hf.trainer import Trainer
        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
