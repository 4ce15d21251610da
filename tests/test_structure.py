"""The package layout the README's architecture section describes, checked.

Layers, bottom-up: the core (``ds_upipe`` top-level modules) < ``hf_patches`` < ``ds_upipe.integration``
< ``ds_upipe.tools``.  A module may import from its own layer or below, never above; no modules import
each other in a circle (also through an import inside a function); the core imports neither
transformers nor pydantic when it is imported; and the cheap entry points stay cheap.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ds_upipe", "hf_patches")
LAYERS = {"core": 0, "hf_patches": 1, "integration": 2, "tools": 3}
#: third-party packages the core must not import at module level
CORE_FORBIDDEN = ("transformers", "pydantic")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name of ours; None for third-party modules."""
    parts = module.split(".")
    if parts[0] == "hf_patches":
        return LAYERS["hf_patches"]
    if parts[0] != "ds_upipe":
        return None
    if len(parts) > 1 and parts[1] in ("integration", "tools"):
        return LAYERS[parts[1]]
    return LAYERS["core"]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue  # annotations only: never executed
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # "from . import tools" imports the submodule tools: judge base.name, whose layer is base's
                # own unless the name is a subpackage
                found.extend((f"{base}.{a.name}", child.lineno, top) for a in child.names)
            inner = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, inner)

    visit(tree, True)
    return found


def package_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def upward_imports(module: str, source: str, is_package: bool = False) -> list[str]:
    """Every import in ``source`` (the text of ``module``) that breaks the layering."""
    bad = []
    own = layer_of(module)
    for target, line, top in imports_of(source, module, is_package):
        layer = layer_of(target)
        if layer is not None and layer > own:
            bad.append(f"{module}:{line} imports {target} (a higher layer)")
        if own == LAYERS["core"] and top and target.split(".")[0] in CORE_FORBIDDEN:
            bad.append(f"{module}:{line} imports {target} at module level (core)")
    return bad


def test_no_upward_imports():
    modules = package_modules()
    assert len(modules) > 20 and any(m.parent.name == "integration" for m in modules)
    bad = [
        b
        for m in modules
        for b in upward_imports(module_name(m), m.read_text(encoding="utf-8"), m.name == "__init__.py")
    ]
    assert bad == []


@pytest.mark.parametrize(
    "module, source, expected",
    [
        ("ds_upipe.pipeline", "def f():\n    from .integration import engine\n", "ds_upipe.integration.engine"),
        ("ds_upipe.schedule", "from ds_upipe.tools.bench import BenchSpec\n", "ds_upipe.tools.bench"),
        ("hf_patches.patch", "from ds_upipe.integration.config import parse_config\n", "ds_upipe.integration"),
        ("ds_upipe.integration.engine", "from ..tools import ranks\n", "ds_upipe.tools.ranks"),
        ("ds_upipe.layer", "import transformers\n", "transformers at module level"),
        ("ds_upipe.heads", "try:\n    from pydantic import BaseModel\nexcept ImportError:\n    pass\n", "pydantic"),
    ],
)
def test_layer_walk_catches_a_bad_import(module, source, expected):
    bad = upward_imports(module, source)
    assert any(expected in b for b in bad), bad


def test_layer_walk_allows_downward_and_annotation_imports():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .tools import cli\nfrom . import schedule\n"
    assert upward_imports("ds_upipe", source, is_package=True) == []
    assert upward_imports("ds_upipe.tools.cli", "from ..integration import engine\nimport hf_patches\n") == []


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of ``sources`` (name -> (text, is a package)) it imports, at module level or
    inside a function (an import in a function is still an edge: it only hides it)."""

    def ours(target: str) -> str | None:
        while target and target not in sources:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {}
    for name, (source, is_package) in sources.items():
        targets = (ours(t) for t, _, _ in imports_of(source, name, is_package))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles():
    modules = package_modules()
    sources = {module_name(m): (m.read_text(encoding="utf-8"), m.name == "__init__.py") for m in modules}
    graph = import_graph(sources)
    assert "ds_upipe.windows" in graph["ds_upipe.kernel_choice"]  # the graph was built
    assert import_circles(graph) == []


def test_circle_walk_catches_a_circle_through_a_function_import():
    sources = {
        "ds_upipe.kernels": ("def make():\n    from .windows import windowed\n", False),
        "ds_upipe.windows": ("from .kernels import AttentionKernel\n", False),
        "ds_upipe.schedule": ("import torch\n", False),
    }
    assert import_circles(import_graph(sources)) == [["ds_upipe.kernels", "ds_upipe.windows"]]


def test_every_import_of_ours_names_what_exists():
    """Every ``from <ds_upipe | hf_patches | tests>... import name`` in the packages, tests, benchmarks,
    scripts and examples, also inside a function (where collecting the tests does not run it), names a
    module or attribute that exists: a moved function leaves no import behind."""
    files = [p for d in (*PACKAGES, "tests", "benchmarks", "scripts", "examples") for p in (REPO / d).rglob("*.py")]
    missing = []
    for path in files:
        module = module_name(path)
        for target, line, _ in imports_of(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if target.split(".")[0] not in (*PACKAGES, "tests"):
                continue
            owner, _, name = target.rpartition(".")
            try:
                found = bool(owner) and hasattr(importlib.import_module(owner), name)
                found = found or importlib.util.find_spec(target) is not None
            except ImportError as err:
                found, name = False, f"{name} ({err})"
            if not found:
                missing.append(f"{path.relative_to(REPO)}:{line} imports {name} from {owner}")
    assert len(files) > 60
    assert missing == []


def _loaded_by_import(module: str) -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    return {name for name in rows if name and not name.startswith("imported package")}


@pytest.mark.parametrize("module", ["ds_upipe.schedule", "ds_upipe.heads", "ds_upipe.layout"])
def test_core_import_is_light(module):
    loaded = _loaded_by_import(module)
    assert module in loaded  # the output was parsed
    heavy = sorted(m for m in loaded if m.split(".")[0] in ("deepspeed", "transformers", "pydantic"))
    assert heavy == []


def test_cli_help_is_fast():
    # the console script is ``ds_upipe.tools.cli:main`` (setup.py); -m runs the same import
    cmd = [sys.executable, "-m", "ds_upipe.tools.cli", "--help"]
    best = float("inf")
    for _ in range(3):  # best of three: the machine is shared
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
        best = min(best, time.perf_counter() - start)
        assert proc.returncode == 0 and "usage: ds-upipe" in proc.stdout, proc.stderr[-2000:]
    assert best < 1.0, f"ds-upipe --help took {best:.2f}s"
