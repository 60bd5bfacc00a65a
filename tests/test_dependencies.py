"""Every package gpuformers imports is declared in pyproject.toml, and the package imports on its core dependencies.

A fresh install gets only what pyproject.toml declares: an import of an undeclared package (even one inside a
function, met only on one code path, as `psutil` was for `device_map="auto"`) works on a development machine that
happens to have it and fails for a user. The static tests read every import statement of src/, tests/ and
benchmarks/; the last one imports every module of the package in a process where each installed distribution outside
the core dependencies' closure is made unimportable.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
requirements = pytest.importorskip("packaging.requirements")

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "gpuformers"

# Import names that no extra declares, each probed inside `try: ... except ImportError` and never required.
PROBED = {
    "flash_attn_interface": "FlashAttention-3, built from its repository's hopper/ folder (no PyPI package)",
    "pynvml": "NVML's bindings (nvidia-ml-py), tried only when nvidia-smi is missing (device.py)",
    "vllm": "the peer engine of benchmarks/bench_peer.py, run by the interpreter of its own virtualenv (it pins its "
            "own transformers), never by ours",
}
# Import names whose distribution is named otherwise, for packages that may not be installed here.
DISTRIBUTION_OF = {"flash_attn": "flash-attn", "functorch": "torch", "jinja2": "jinja2", "yaml": "pyyaml", "zmq": "pyzmq"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    """{"core": {distribution, ...}, extra: {...}} from pyproject.toml, names normalised."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    return {group: {_normal(requirements.Requirement(spec).name) for spec in specs} for group, specs in groups.items()}


def _imports(folder: Path) -> dict[str, set[str]]:
    """Top-level names of every absolute import under `folder` (module level and inside functions alike) that are
    neither the standard library nor the project itself -> the files that import them."""
    found: dict[str, set[str]] = {}
    local = {path.stem for path in folder.rglob("*.py")} | {"gpuformers", "tests"}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _distribution(import_name: str) -> str:
    installed = metadata.packages_distributions().get(import_name)
    if installed:
        return _normal(installed[0])
    return _normal(DISTRIBUTION_OF.get(import_name, import_name))


def _undeclared(folder: Path, allowed: set[str]) -> dict[str, list[str]]:
    return {name: sorted(files) for name, files in _imports(folder).items()
            if name not in PROBED and _distribution(name) not in allowed}


def test_every_package_import_is_declared_in_core_or_an_extra():
    declared = _declared()
    allowed = set().union(*(names for group, names in declared.items() if group != "dev"))
    missing = _undeclared(SRC, allowed)
    assert not missing, (f"src/gpuformers imports packages that pyproject.toml does not declare (add each to "
                         f"`dependencies` or to the extra whose feature needs it): {missing}")


def test_every_test_and_benchmark_import_is_declared_in_dev():
    declared = _declared()
    allowed = declared["core"] | declared["dev"]
    for folder in (ROOT / "tests", ROOT / "benchmarks"):
        missing = _undeclared(folder, allowed)
        assert not missing, f"{folder.name}/ imports packages the `dev` extra does not declare: {missing}"


def _core_closure() -> set[str]:
    """The core dependencies and everything they require in turn (with no extra), as installed here."""
    seen: set[str] = set()
    todo = list(_declared()["core"])
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            requirement = requirements.Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(_normal(requirement.name))
    return seen


# Modules that are the feature of an extra and import its package at module level: on the core install they must
# fail with ModuleNotFoundError naming a package of that extra, and nothing else.
NEEDS_EXTRA = {
    "gpuformers.serving": "serve",
    # The bitsandbytes layers subclass bitsandbytes' own; quantization/bnb.py imports this module only once it found it.
    "gpuformers.quantization.bnb_layers": "quant",
    # Triton programs (`@triton.jit` needs a source file): imported only once kernels/checks.py found Triton.
    **{f"gpuformers.{name}": "kernels" for name in (
        "engine.paged_attention_triton", "kernels.attention", "kernels.fused_linear_cross_entropy", "kernels.moe",
        "kernels.mxfp4_matmul", "kernels.rms_norm", "kernels.rotary", "kernels.swiglu", "kernels.weight_only_matmul",
        "kernels.ssd", "kernels.ssd_backward", "kernels.causal_conv1d", "quantization.fp8_matmul")},
}


def test_every_module_imports_on_the_core_dependencies_alone():
    closure = _core_closure()
    blocked = sorted({name for name, dists in metadata.packages_distributions().items()
                      if name.isidentifier() and not any(_normal(d) in closure for d in dists)} - {"gpuformers"})
    script = textwrap.dedent("""
        import importlib, json, pkgutil, sys
        for name in json.loads(sys.argv[1]):
            sys.modules[name] = None  # `import name` raises ModuleNotFoundError, find_spec(name) answers None
        import gpuformers
        failures = {}
        for module in pkgutil.walk_packages(gpuformers.__path__, "gpuformers."):
            if module.name.endswith("__main__"):  # runs the command line
                continue
            try:
                importlib.import_module(module.name)
            except ModuleNotFoundError as error:
                failures[module.name] = ["missing", error.name]
            except Exception as error:
                failures[module.name] = ["error", repr(error)]
        print(json.dumps(failures))
    """)
    result = subprocess.run([sys.executable, "-c", script, json.dumps(blocked)], capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    declared = _declared()
    wrong = {}
    for module, (kind, detail) in failures.items():
        extra = next((extra for prefix, extra in NEEDS_EXTRA.items()
                      if module == prefix or module.startswith(prefix + ".")), None)
        ok = (kind == "missing" and extra is not None and detail is not None
              and _distribution(detail.split(".")[0]) in declared[extra])
        if not ok:
            wrong[module] = [kind, detail]
    assert not wrong, (f"modules that do not import on the core dependencies alone (guard the optional import, "
                       f"or import it inside the function that needs it): {wrong}")
