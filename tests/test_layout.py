"""The package layers and the import graph, read from the source with ``ast``.

Every import an ``import`` statement can make counts, also one inside a
function: a lazy import still ties the two modules together. The layer order
is written once, here, bottom up; a module may import its own package and the
packages of lower layers, nothing else.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Bottom up. Packages on one line are siblings: neither imports the other.
LAYERS = [
    ["hybrid.errors"],
    ["hybrid.diagnostics"],  # the flight recorder: the comm door records into it
    # layout math, ParallelState, the comm door, agree
    ["hybrid.parallel"],
    # a schedule's vocabulary, its generators and the simulator, torch-free: the estimator
    # plays a schedule to find what each stage holds and the bubble
    ["hybrid.pipeline.actions"],
    ["hybrid.pipeline.schedules", "hybrid.pipeline.simulator"],
    ["hybrid.config"],  # torch-free: flags -> checked, frozen sections
    ["hybrid.kernels", "hybrid.data", "hybrid.estimate"],
    ["hybrid.tensor_parallel"],
    ["models", "hybrid.recompute"],
    ["hybrid.zero"],
    ["hybrid.pipeline"],  # schedules, their simulator, the executor, P2P
    # the Hugging Face name tables, pure tensor functions: the peers' checkpoints
    # (hybrid.checkpoint.peers) map their names through the same tables
    ["hybrid.hf"],
    ["hybrid.checkpoint"],
    ["hybrid.train"],  # the training loop
    # hybrid.initialize's engine: DeepSpeed's verbs on any nn.Module; it takes the loop's
    # LR schedule and orphan guard, and DeepSpeed's module layout (below) sits on it
    ["hybrid.engine"],
    ["hybrid.testing"],  # the process pool of tests and benchmarks
    # the package's own door (hybrid/__init__.py), and beside it DeepSpeed's module layout
    # over the same engine (import hybrid.deepspeed as deepspeed): nothing imports it
    ["hybrid", "hybrid.deepspeed"],
    # the benches (python -m benchmarks.bench_*) beside the user tools: neither imports the other
    ["benchmarks", "scripts"],
]
LAYER_OF = {unit: i for i, line in enumerate(LAYERS) for unit in line}
# Packages that must import without torch: the launcher checks a command line with
# them before any worker starts, and the estimator runs on a laptop. hybrid-deepspeed's
# launcher hands over to torchrun, whose workers import torch themselves.
TORCH_FREE = ["hybrid.config", "hybrid.estimate", "hybrid.parallel.layout",
              "hybrid.pipeline.actions", "hybrid.pipeline.schedules",
              "hybrid.pipeline.simulator", "hybrid.deepspeed.launcher"]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
    files = [*ROOT.glob("hybrid/**/*.py"), *ROOT.glob("models/**/*.py"),
             *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("scripts/*.py")]
    return {_module_name(p): p for p in files}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (the deepest module each statement names)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            mod = t
            while mod and mod not in known:  # import a.b.c where only a.b is ours
                mod = mod.rpartition(".")[0]
            if mod:
                found.add(mod)
    found.discard(name)
    return found


def _unit(module: str) -> str | None:
    best = None
    for unit in LAYER_OF:
        if (module == unit or module.startswith(unit + ".")) and (
                best is None or len(unit) > len(best)):
            best = unit
    return best


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    known = set(sources)
    return {m: _imports(m, p, known) for m, p in sources.items()}


def test_every_module_has_a_layer():
    homeless = sorted(m for m in _sources() if _unit(m) is None)
    assert not homeless, f"modules outside the layer table in {__file__}: {homeless}"


def test_imports_only_go_down():
    wrong = []
    for module, targets in _graph().items():
        unit = _unit(module)
        for t in targets:
            other = _unit(t)
            if other != unit and LAYER_OF[other] >= LAYER_OF[unit]:
                wrong.append(f"{module} -> {t} ({unit} is layer {LAYER_OF[unit]}, "
                             f"{other} layer {LAYER_OF[other]})")
    assert not wrong, "imports that do not go down:\n" + "\n".join(sorted(wrong))


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_circles():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle():
    """The check above can fail: a three-module circle is found and named."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_torch_free_packages_import_without_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE)
            + "import hybrid.config.build, hybrid.estimate.memory\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m == 'numpy')\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
