"""The built-in corpus: English prose every Python install carries.

The no-argument run must train on real text with no download and no data file
in the repository. The docstrings of the standard library's top-level modules
(about 0.9 MB of English with some code) are exactly that. They are read with
``ast`` -- nothing is imported -- in sorted file order, so the corpus is the
same on every machine with the same Python version.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import sysconfig
from collections import deque

_MIN_CHARS = 40  # one-line docstrings ("Return x.") teach little
_DEFS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case)  # what a definition can sit in


def builtin_documents() -> list[str]:
    """Docstrings of modules, classes and functions of the stdlib, one document each.

    Parsed once per process (about a second of ``ast`` work); later calls, as by
    several runs in one process, get a copy of the same list.
    """
    return list(_parse(sysconfig.get_paths()["stdlib"]))


@functools.lru_cache(maxsize=1)
def _parse(stdlib: str) -> tuple[str, ...]:
    docs = []
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in _definitions(tree):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= _MIN_CHARS:
                docs.append(doc)
    if not docs:
        raise RuntimeError(f"no docstrings found under {stdlib}; pass --data-path FILE.txt")
    return tuple(docs)


def _definitions(tree: ast.Module):
    """The module, class and function nodes of ``tree`` in ``ast.walk``'s order (breadth
    first, fields in order), visiting statements only: a definition is never inside an
    expression, and skipping the expressions halves the walk."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        if isinstance(node, _DEFS):
            yield node
        for field in node._fields:
            value = getattr(node, field)
            if isinstance(value, list):
                todo.extend(c for c in value if isinstance(c, _HOLDERS))
