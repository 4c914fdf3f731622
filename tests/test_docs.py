"""The docs cannot point at what is not there.

Every repository path a doc names exists, and a doc names code by function,
not by line: a ``path.py:123`` goes stale with the next edit above line 123
(docs/diagnostics.md's sample reports cited ``optimizer.py:307`` in a 257-line
file). A ``path.py in name`` (how a report names where a rank was) must name a
function or class that the file defines.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
PATH = re.compile(r"\b((?:hybrid|scripts|tests|models|benchmarks|csrc|examples)/[\w./-]+"
                  r"\.(?:py|sh|cu|cpp|h|md|json))\b")
# Paths of other projects that a doc names as theirs
ELSEWHERE = {"examples/gpt3/train_gpt3_175b_distributed.sh"}  # Megatron-LM's


def _cited():
    for doc in DOCS:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            yield doc.relative_to(ROOT), n, line


def test_every_path_a_doc_names_exists():
    missing = [f"{doc}:{n}: {m.group(1)}" for doc, n, line in _cited()
               for m in PATH.finditer(line)
               if m.group(1) not in ELSEWHERE and not (ROOT / m.group(1)).exists()]
    assert not missing, "\n".join(missing)


def test_docs_cite_functions_not_line_numbers():
    found = [f"{doc}:{n}: {m.group(0)}" for doc, n, line in _cited()
             for m in re.finditer(r"\b[\w/]+\.py:\d+", line)]
    assert not found, "\n".join(found)


def test_a_cited_function_is_defined_in_its_file():
    wrong = []
    for doc, n, line in _cited():
        for m in re.finditer(r"\b([\w/]+\.py) in (\w+)\b", line):
            path, name = ROOT / m.group(1), m.group(2)
            if not path.exists():
                continue  # (the path test says so)
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b",
                             path.read_text(encoding="utf-8"), re.M):
                wrong.append(f"{doc}:{n}: {m.group(0)}")
    assert not wrong, "\n".join(wrong)
