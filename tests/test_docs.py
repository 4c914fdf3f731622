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
ELSEWHERE = {"examples/gpt3/train_gpt3_175b_distributed.sh",  # Megatron-LM's
             "examples/mixtral/train_mixtral_8x7b_distributed.sh"}


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


# -- docs/layout.md: a row for every module, and the long ones named --------------------------

LAYOUT = ROOT / "docs" / "layout.md"
LONG = 600  # lines past which a module is named in layout.md with why it is one job


def _layout_sections() -> dict[str, tuple[set[str], str]]:
    """{package dir: (the file names its table rows list, the section's text)}."""
    out: dict[str, tuple[set[str], str]] = {}
    current = None
    for line in LAYOUT.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#{2,3} `([\w/]+)/`", line)
        if m or line.startswith("## "):
            current = m.group(1) if m else None
            if current is not None:
                out[current] = (set(), "")
            continue
        if current is None:
            continue
        listed, body = out[current]
        if line.startswith("| `"):
            listed |= set(re.findall(r"`([\w.]+\.(?:py|sh))`", line.split("|")[1]))
        out[current] = (listed, body + line + "\n")
    return out


def _packages() -> dict[str, set[str]]:
    """{every directory of the tree's Python code: its modules (and scripts' shell files)}."""
    out = {}
    for top in ("hybrid", "models", "benchmarks", "scripts"):
        for d in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            names = {f.name for f in d.glob("*.py") if f.name != "__init__.py"}
            if top == "scripts":
                names |= {f.name for f in d.glob("*.sh")}
            if names and "__pycache__" not in d.parts:
                out[d.relative_to(ROOT).as_posix()] = names
    return out


def test_layout_md_has_a_row_for_every_module_and_a_module_for_every_row():
    sections, packages = _layout_sections(), _packages()
    packages.pop("hybrid")  # errors.py: named in the layers list
    assert "`hybrid/errors.py`" in LAYOUT.read_text(encoding="utf-8")
    missing = sorted(set(packages) - set(sections))
    assert not missing, f"docs/layout.md has no section for {missing}"
    wrong = {d: (sorted(packages[d] - listed), sorted(listed - packages[d]))
             for d, (listed, _) in sections.items() if d in packages and listed != packages[d]}
    assert not wrong, f"(unlisted modules, rows of no module) by section: {wrong}"


def test_a_module_over_600_lines_is_named_with_its_reason():
    text = LAYOUT.read_text(encoding="utf-8")
    named = text[text.index("## Modules over 600 lines"):].split("\n## ")[0]
    long = sorted(p.relative_to(ROOT).as_posix()
                  for top in ("hybrid", "models", "benchmarks", "scripts")
                  for p in (ROOT / top).rglob("*.py")
                  if sum(1 for _ in p.open(encoding="utf-8")) > LONG)
    listed = sorted(set(re.findall(r"`((?:hybrid|models|benchmarks|scripts)/[\w/]+\.py)`",
                                   named)))
    assert listed == long, f"over {LONG} lines: {long}; named in docs/layout.md: {listed}"
