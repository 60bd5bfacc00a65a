"""The package layers of docs/architecture.md hold: the import-linter contract in pyproject.toml passes, and the
import graph of src/gpuformers folded to its top-level packages and modules has no cycle, counting every import
(inside functions too) but those under `if TYPE_CHECKING:`. Also: no second, CPU-only forward inside the models."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gpuformers"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return inside


def _imported_modules(path: Path) -> set[str]:
    """The gpuformers modules `path` imports, as dotted names (relative imports resolved)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    if parts[-1] == "__init__":
        package = parts[:-1]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            if base == "gpuformers":
                found.update(f"gpuformers.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("gpuformers.")}


def _unit(module: str) -> str:
    return module.split(".")[1]  # the top-level package or module under gpuformers


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = _unit("gpuformers." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        for target in _imported_modules(path):
            if _unit(target) != source:
                graph.setdefault(source, set()).add(_unit(target))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_graph_has_no_cycle():
    graph = package_graph()
    assert "models" in graph and "layers" in graph["models"]  # the graph is read at all
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


@pytest.mark.skipif(shutil.which("lint-imports") is None and not (Path(sys.executable).parent / "lint-imports").exists(),
                    reason="import-linter is not installed (pip install -e '.[dev]')")
def test_the_import_linter_contract_holds():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    done = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_models_and_layers_have_one_forward():
    """No shadow forward in the model code: nn.Module.__call__ is never bypassed and no CPU-only variant is kept."""
    for folder in ("models", "layers"):
        for path in (PACKAGE / folder).rglob("*.py"):
            text = path.read_text()
            for marker in ("plain_calls", "kept_answer", "decode_step", "cpu_rms", "_call_impl"):
                assert marker not in text, f"{path.relative_to(ROOT)} mentions {marker!r}"
            # a submodule's forward called directly, past its hooks
            assert not re.search(r"self\.\w+\.forward\(|\]\.forward\(", text), path.relative_to(ROOT)
    assert not (PACKAGE / "models" / "decode_step.py").exists()
