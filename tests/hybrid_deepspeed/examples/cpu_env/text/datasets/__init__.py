"""A stand-in for the part of Hugging Face's ``datasets`` HelloDeepSpeed uses, for a machine
that cannot download: ``load_dataset("wikitext", ..., split=...)`` gives synthetic lines
of text of wikitext's kind (words of a small fixed vocabulary, some lines empty), drawn
from the line's index, with the ``filter`` and ``map`` the script calls. The same under
DeepSpeed and under hybrid (this folder is on PYTHONPATH for both runs).

``$EXAMPLE_TEXT_LINES`` lines (default 256)."""

import os

from datasets import arrow_dataset
from datasets.words import line

__all__ = ["arrow_dataset", "load_dataset"]

def load_dataset(path, name=None, split=None, **kwargs):
    size = int(os.environ.get("EXAMPLE_TEXT_LINES", "256"))
    return arrow_dataset.Dataset([{"text": line(i)} for i in range(size)])
