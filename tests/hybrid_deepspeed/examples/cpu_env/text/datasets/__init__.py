"""A stand-in for the part of Hugging Face's ``datasets`` the examples use, for a machine
that cannot download, the same under DeepSpeed and under hybrid (this folder is on
PYTHONPATH for both runs):

* ``load_dataset("wikitext", ..., split=...)`` (HelloDeepSpeed): synthetic lines of text of
  wikitext's kind (words of a small fixed vocabulary, some lines empty), drawn from the
  line's index; ``$EXAMPLE_TEXT_LINES`` lines (default 256);
* ``load_dataset("tatsu-lab/alpaca")`` (SuperOffload's fine-tuning script): a ``train``
  split of instruction / input / output records of the same words, every other input
  empty as in Alpaca; ``$EXAMPLE_TEXT_LINES`` records.

Any other name is refused, naming the two it serves."""

import os

from datasets import arrow_dataset
from datasets.words import line

__all__ = ["arrow_dataset", "load_dataset"]


def _size() -> int:
    return int(os.environ.get("EXAMPLE_TEXT_LINES", "256"))


def _alpaca(i: int) -> dict:
    return {"instruction": line(3 * i) or "the", "input": line(3 * i + 1) if i % 2 else "",
            "output": line(3 * i + 2) or "a"}


def load_dataset(path, name=None, split=None, **kwargs):
    if path == "wikitext":
        return arrow_dataset.Dataset([{"text": line(i)} for i in range(_size())])
    if path == "tatsu-lab/alpaca":
        return {"train": arrow_dataset.Dataset([_alpaca(i) for i in range(_size())])}
    raise ValueError(f"the examples' datasets stand-in serves 'wikitext' and "
                     f"'tatsu-lab/alpaca', not {path!r}")
