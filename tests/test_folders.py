"""No test folder can stand in for a package a test imports (tests/__init__.py's Note).

Read from the source with ``ast``: every folder under ``tests/`` that holds Python is a
package, and none is named like a third-party package that any test imports (by an
``import`` statement anywhere in a file, or by name through ``importorskip``,
``import_module``, ``find_spec`` or the ``peer`` mark).
"""

from __future__ import annotations

import ast
import pathlib
import sys

from tests.helpers.peers import PEERS

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# calls whose first argument names a module a test imports
_BY_NAME = {"importorskip", "import_module", "find_spec", "peer", "installed", "missing"}
# Folders no test imports from: their files run in a child process, as a script or with the
# folder on PYTHONPATH (DeepSpeedExamples' scripts as published, and the torchvision
# stand-in a CPU-only run of them needs: tests/hybrid_deepspeed/examples). They hold no
# test file, so pytest never puts them on sys.path (checked below); what they import is
# the child's business, and their stand-in is named like the package it stands in for.
RUN_ONLY = ("hybrid_deepspeed/examples/upstream", "hybrid_deepspeed/examples/cpu_env")


def _run_only(path: pathlib.Path, tests: pathlib.Path) -> bool:
    rel = path.relative_to(tests).as_posix()
    return any(rel == r or rel.startswith(r + "/") for r in RUN_ONLY)


def _first_party(root: pathlib.Path) -> set[str]:
    """Top-level names the checkout itself provides (hybrid, models, tests, scripts, ...)."""
    return {p.stem for p in root.iterdir() if p.is_dir() or p.suffix == ".py"}


def imported_modules(tests: pathlib.Path) -> dict[str, set[str]]:
    """Top-level module name -> the test files (relative paths) that import it."""
    found: dict[str, set[str]] = {}
    for path in sorted(tests.rglob("*.py")):
        if _run_only(path, tests):
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                arg = node.args[0]
                if called in _BY_NAME and isinstance(arg, ast.Constant) and \
                        isinstance(arg.value, str):
                    names.add(arg.value)
        for name in names:
            found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(tests)))
    return found


def shadowing_folders(tests: pathlib.Path, first_party: set[str]) -> list[str]:
    """Folders under ``tests`` named like a third-party module a test imports, each with
    the files that import it: what the folder would shadow, were it on sys.path."""
    third_party = {name: files for name, files in imported_modules(tests).items()
                   if name not in first_party and name not in sys.stdlib_module_names}
    for module in PEERS:  # the peers, whether or not a test names them yet
        third_party.setdefault(module.split(".")[0], set()).add("tests/helpers/peers.py")
    return [f"tests/{d.relative_to(tests)}/ is named like {d.name!r}, which "
            f"{', '.join(sorted(third_party[d.name]))} import(s)"
            for d in sorted(tests.rglob("*"))
            if d.is_dir() and d.name in third_party and not _run_only(d, tests)]


def folders_without_init(tests: pathlib.Path) -> list[str]:
    """Folders under ``tests`` (and itself) that hold Python files but no __init__.py."""
    return [str(d) for d in [tests, *sorted(tests.rglob("*"))]
            if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").exists()
            and not (d != tests and _run_only(d, tests))]


def test_every_test_folder_is_a_package():
    assert folders_without_init(TESTS) == []


def test_no_test_folder_is_named_like_a_package_a_test_imports():
    assert shadowing_folders(TESTS, _first_party(ROOT)) == []


def test_the_run_only_folders_hold_no_test_and_no_test_imports_them():
    """What makes RUN_ONLY safe: no test file inside (pytest puts only a test file's
    folder chain on sys.path), and no ``tests.<folder>`` import of them anywhere."""
    for rel in RUN_ONLY:
        assert (TESTS / rel).is_dir(), rel
        assert not list((TESTS / rel).rglob("test_*.py")), rel
        dotted = "tests." + rel.replace("/", ".")
        users = [m for m, files in imported_modules(TESTS).items() if m == "tests"
                 for f in files if dotted in (TESTS / f).read_text(encoding="utf-8")]
        assert not users, (rel, users)


def test_the_checks_find_a_shadowing_folder(tmp_path):
    """The checks above on a tree made to fail them: a ``deepspeed`` folder without an
    __init__.py, beside a test that imports deepspeed by name."""
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "test_x.py").write_text("import hybrid\n")
    (tmp_path / "test_y.py").write_text(
        "import pytest\nds = pytest.importorskip('deepspeed.runtime')\n")
    assert shadowing_folders(tmp_path, {"hybrid"}) == [
        "tests/deepspeed/ is named like 'deepspeed', which test_y.py, "
        "tests/helpers/peers.py import(s)"]
    assert folders_without_init(tmp_path) == [str(tmp_path), str(tmp_path / "deepspeed")]


def test_a_skip_for_want_of_a_peer_is_named_and_an_unknown_peer_refused():
    """What tests/conftest.py's hooks decide with: the skip messages that name a peer (an
    unmarked test skipping with one of these fails), and peer() of an unknown module."""
    import pytest

    from tests.helpers.peers import missing, named_in
    assert named_in("could not import 'deepspeed': No module named 'deepspeed'") == "deepspeed"
    assert named_in("No module named 'megatron'") == "megatron.core"
    assert named_in("could not import 'megatron.core.datasets'") == "megatron.core"
    assert named_in("needs a CUDA device") is None
    with pytest.raises(ValueError, match="peer\\('torchtitan'\\): not one of"):
        missing("torchtitan")
