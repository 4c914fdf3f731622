"""The built-in corpus: English prose every Python install carries.

The no-argument run must train on real text with no download and no data file
in the repository. The docstrings of the standard library's top-level modules
(about 0.9 MB of English with some code) are exactly that. They are read with
``ast`` -- nothing is imported -- in sorted file order, so the corpus is the
same on every machine with the same Python version.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import hashlib
import json
import logging
import os
import sys
import sysconfig
import tempfile
from collections import deque

log = logging.getLogger(__name__)

_MIN_CHARS = 40  # one-line docstrings ("Return x.") teach little
_DEFS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case)  # what a definition can sit in


def builtin_documents(cache_dir: str | None = None) -> list[str]:
    """Docstrings of modules, classes and functions of the stdlib, one document each.

    Parsing takes about 1.4 s per process, the largest part of a small run's start.
    With ``cache_dir`` the documents are kept there as one JSON file named for the
    Python version and the stdlib's files (names, sizes, modification times), so a
    later run -- each rank of it -- reads 0.9 MB instead; another Python or a changed
    stdlib gets a file of its own. The cache is only ever a shortcut: a missing,
    unreadable or corrupt file means parsing again, and a directory that cannot be
    written to means not caching. Within one process the parse is kept in memory too.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if cache_dir is None:
        return list(_parse(stdlib, tuple(files)))
    path = os.path.join(cache_dir, f"builtin-corpus-{_fingerprint(files)}.json")
    docs = _read_cache(path)
    if docs is None:
        docs = list(_parse(stdlib, tuple(files)))
        _write_cache(path, docs)
    return docs


def _fingerprint(files: list[str]) -> str:
    h = hashlib.sha256(f"{sys.version}\0{_MIN_CHARS}\n".encode())
    for path in files:
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _read_cache(path: str) -> list[str] | None:
    try:
        with open(path, encoding="utf-8") as f:
            docs = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # (JSONDecodeError and UnicodeDecodeError are both)
        log.warning("built-in corpus cache %s unreadable (%s): parsing the stdlib again",
                    path, e)
        return None
    if not (isinstance(docs, list) and docs and all(isinstance(d, str) for d in docs)):
        log.warning("built-in corpus cache %s is not a list of documents: parsing the "
                    "stdlib again", path)
        return None
    return docs


def _write_cache(path: str, docs: list[str]) -> None:
    """Write ``docs`` to ``path`` whole or not at all: ranks racing to write the same
    file each rename a complete file of their own over it."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # a name no other process has, on any host sharing the directory
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(docs, f)
        os.replace(tmp, path)
    except OSError as e:
        log.info("built-in corpus not cached in %s (%s)", os.path.dirname(path), e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)


@functools.lru_cache(maxsize=1)
def _parse(stdlib: str, files: tuple[str, ...]) -> tuple[str, ...]:
    docs = []
    for path in files:
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
    todo: deque[ast.AST] = deque([tree])
    while todo:
        node = todo.popleft()
        if isinstance(node, _DEFS):
            yield node
        for field in node._fields:
            value = getattr(node, field)
            if isinstance(value, list):
                todo.extend(c for c in value if isinstance(c, _HOLDERS))
