"""Each package's docstring is its table of contents, and the table is true.

Read from the source with ``ast``: the docstring of every ``hybrid/**/__init__.py``
names each module ``X.py`` and each subpackage of its folder as ``:mod:`.X``` (or by its
full path, ``:mod:`hybrid.pkg.X``` / ``:mod:`~hybrid.pkg.X```), and every module a
package docstring names, relatively or by a ``hybrid.`` path, exists. A module added,
moved or removed without its package's docstring following fails here.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# :mod:`.name`, :mod:`hybrid.pkg.name`, :mod:`~hybrid.pkg.name`
_MOD = re.compile(r":mod:`~?([\w.]+)`")


def members(folder: pathlib.Path) -> set[str]:
    """The modules (``X.py`` but ``__init__.py``) and subpackages of a package's folder."""
    return ({p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
            | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()})


def _exists(root: pathlib.Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_doc_problems(root: pathlib.Path, top: str = "hybrid") -> list[str]:
    """One line per package under ``root/top`` whose docstring leaves out a module or
    subpackage of its folder, or names a module that is not there."""
    problems = []
    for init in sorted((root / top).rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(root).parts)
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        named, absent = set(), set()
        for target in _MOD.findall(doc):
            full = package + target if target.startswith(".") else target
            if full.startswith(package + "."):
                rest = full[len(package) + 1:]
                if "." not in rest:
                    named.add(rest)
            if full.split(".")[0] == top and not _exists(root, full):
                absent.add(target)
        missing = sorted(members(init.parent) - named)
        said = [f"does not name {', '.join('.' + m for m in missing)}"] if missing else []
        said += [f"names {', '.join(sorted(absent))}, which is not a module"] if absent else []
        if said:
            problems.append(f"{init.relative_to(root)} ({package}): {'; '.join(said)}")
    return problems


def test_every_package_docstring_names_its_modules_and_nothing_else():
    problems = package_doc_problems(ROOT)
    assert not problems, "package docstrings out of date (name each module as " \
                         "* :mod:`.name` what it does):\n" + "\n".join(problems)


def test_the_check_finds_an_unnamed_module_and_a_named_missing_one(tmp_path):
    """The check above on a tree made to fail it: ``pkg`` names ``.kept`` and ``.gone``
    (deleted) and not ``.new``; ``pkg.sub`` is named by its full path, and names
    ``hybrid``-style paths of its own, one of them missing."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        '"""A package.\n\n* :mod:`.kept` here\n* :mod:`.gone` removed\n'
        '* :mod:`~pkg.sub` a subpackage\n"""\n')
    (pkg / "kept.py").write_text("")
    (pkg / "new.py").write_text('"""Added, and not in the docstring."""\n')
    (pkg / "sub" / "__init__.py").write_text(
        '"""Sub: :mod:`pkg.sub.a`, and :mod:`pkg.sub.b.c` (not there)."""\n')
    (pkg / "sub" / "a.py").write_text("")
    (pkg / "notes").mkdir()  # a folder without __init__.py is not a subpackage
    assert package_doc_problems(tmp_path, top="pkg") == [
        "pkg/__init__.py (pkg): does not name .new; names .gone, which is not a module",
        "pkg/sub/__init__.py (pkg.sub): names pkg.sub.b.c, which is not a module"]
