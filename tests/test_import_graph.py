"""The shape of radixlm's import graph: no cycles, and lower layers never import upper ones.

The graph is read from the source with ``ast``, not by importing: every ``import`` and
``from ... import`` counts, including those under ``if TYPE_CHECKING:`` and inside
functions, since a cycle hidden from the interpreter is still a cycle in the design.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``;
relative imports are resolved against the importing module's package. Importing
``a.b.c`` adds no edge to ``a`` or ``a.b``: a submodule of one's own package is no cycle.

The walker is checked on small synthetic packages, so that both tests can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import radixlm

PACKAGE_DIR = Path(radixlm.__file__).parent

LAYER_RULES = {
    # importer's subpackage: the subpackages it must not import
    "kernels": ("runtime", "frontend_lang", "models"),
    "kv_cache": ("runtime", "frontend_lang", "models"),
    "models": ("runtime", "frontend_lang"),
}
"""The one-way dependencies of docs/architecture.md: runtime -> models -> kernels; the KV cache
and the kernels below the models."""


# ---- the walker -------------------------------------------------------------------------------


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (``__init__`` files
    name their package)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_edges(package_dir: Path) -> dict[str, dict[str, int]]:
    """importer -> {imported module of the same package -> line of its first import}."""
    modules = module_files(package_dir)
    edges: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _imported_modules(node, name, is_package, modules):
                if target != name:  # ast.walk is breadth first: keep the smallest line
                    line = edges[name].get(target, node.lineno)
                    edges[name][target] = min(line, node.lineno)
    return edges


def _imported_modules(
    node: ast.AST, importer: str, is_package: bool, modules: dict[str, Path]
) -> list[str]:
    if isinstance(node, ast.Import):
        return [m for m in (_known_prefix(a.name, modules) for a in node.names) if m]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = _absolute_module(node, importer, is_package)
    found = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in modules:
            found.append(submodule)
        elif base in modules:
            found.append(base)
    return found


def _absolute_module(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module a ``from`` import reads from, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if node.level - 1 >= len(package):
        raise ValueError(f"{importer}: relative import beyond the top-level package")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known_prefix(dotted: str, modules: dict[str, Path]) -> str | None:
    """``import a.b.c`` binds a.b.c's module: the longest prefix that is one of ours."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted."""
    reach = {name: _reachable(name, edges) for name in edges}
    components, seen = [], set()
    for name in sorted(edges):
        if name in seen:
            continue
        component = sorted(m for m in reach[name] if name in reach[m])
        seen.update(component)
        if len(component) > 1:
            components.append(component)
    return components


def _reachable(start: str, edges: dict[str, dict[str, int]]) -> set[str]:
    found, stack = {start}, [start]
    while stack:
        for target in edges[stack.pop()]:
            if target not in found:
                found.add(target)
                stack.append(target)
    return found


def describe_cycles(cycles: list[list[str]], edges: dict[str, dict[str, int]]) -> str:
    """Each cycle with the imports that close it (importer:line -> imported)."""
    lines = []
    for component in cycles:
        lines.append("cycle: " + ", ".join(component))
        members = set(component)
        for importer in component:
            for target, line in sorted(edges[importer].items()):
                if target in members:
                    lines.append(f"    {importer}:{line} -> {target}")
    return "\n".join(lines)


def layer_violations(
    edges: dict[str, dict[str, int]], package: str, rules: dict[str, tuple[str, ...]]
) -> list[str]:
    """'importer:line -> imported' for every import a layer rule forbids."""
    found = []
    for importer, targets in sorted(edges.items()):
        forbidden = rules.get(_subpackage(importer, package), ())
        for target, line in sorted(targets.items()):
            if _subpackage(target, package) in forbidden:
                found.append(f"{importer}:{line} -> {target}")
    return found


def _subpackage(module: str, package: str) -> str | None:
    """The first component under ``package`` (``radixlm.kernels.x`` -> ``kernels``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == package else None


# ---- radixlm itself ----------------------------------------------------------------------------


def test_radixlm_has_no_import_cycles():
    edges = import_edges(PACKAGE_DIR)
    # the walker saw the whole package and its imports
    assert {"radixlm.kernels.forward_batch", "radixlm.runtime.scheduler.scheduler"} <= set(edges)
    assert "radixlm.kernels.forward_batch" in edges["radixlm.models.llama"]
    cycles = import_cycles(edges)
    assert not cycles, "import cycles (counting TYPE_CHECKING and function-level imports):\n" \
        + describe_cycles(cycles, edges)


def test_kernels_kv_cache_and_models_never_import_the_layers_above_them():
    violations = layer_violations(import_edges(PACKAGE_DIR), "radixlm", LAYER_RULES)
    assert not violations, "imports against the layering of docs/architecture.md:\n" + "\n".join(
        violations
    )


PRIVATE_REGEX_MODULES = ("sre_parse", "sre_compile", "sre_constants",
                         "re._parser", "re._compiler", "re._constants", "re._casefix")
"""CPython's regex internals: private, and changed in any Python release (3.11 moved them)."""


def private_regex_uses(package_dir: Path) -> list[str]:
    """'module:line name' for each import of, or attribute access to, CPython's private
    regex modules (``import sre_parse``, ``from re import _parser``, ``re._parser``)."""
    uses = []
    for name, path in module_files(package_dir).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                used = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                used = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                used = [f"{node.value.id}.{node.attr}"]
            else:
                continue
            uses += [f"{name}:{node.lineno} {u}" for u in used if u in PRIVATE_REGEX_MODULES]
    return uses


def test_radixlm_never_uses_cpython_s_private_regex_parser():
    assert private_regex_uses(PACKAGE_DIR) == []


# ---- the walker, on synthetic packages -------------------------------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    """Writes ``files`` (path relative to ``root`` -> source) and returns the package dir."""
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / next(iter(files)).split("/")[0]


def test_cycles_through_type_checking_function_and_relative_imports_are_found(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from pkg.b import B\n",
        "pkg/b.py": "def load():\n    from .sub import c\n    return c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from .. import a\n",
        "pkg/d.py": "import pkg.a\n",  # into the cycle, not part of it
    })
    edges = import_edges(package)
    assert edges["pkg.a"] == {"pkg.b": 3}
    assert edges["pkg.b"] == {"pkg.sub.c": 2}
    assert edges["pkg.sub.c"] == {"pkg.a": 1}
    cycles = import_cycles(edges)
    assert cycles == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert "pkg.sub.c:1 -> pkg.a" in describe_cycles(cycles, edges)


def test_submodule_imports_add_no_edge_to_parent_packages(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.sub import x\n",
        "pkg/sub/__init__.py": "from pkg.sub.x import VALUE\n",
        "pkg/sub/x.py": "VALUE = 1\n",
        "pkg/sub/y.py": "import pkg.sub.x\nfrom pkg.sub import x, VALUE\nfrom . import x\n",
    })
    edges = import_edges(package)
    assert edges["pkg"] == {"pkg.sub.x": 1}
    # a name that is not a module resolves to the package that defines it
    assert edges["pkg.sub.y"] == {"pkg.sub.x": 1, "pkg.sub": 2}
    assert import_cycles(edges) == []


def test_a_package_importing_a_module_that_imports_it_back_is_a_cycle(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.api import run\n",
        "pkg/api.py": "from pkg import helpers\n",
        "pkg/helpers.py": "import pkg\n",
    })
    assert import_cycles(import_edges(package)) == [["pkg", "pkg.api", "pkg.helpers"]]


def test_a_lower_layer_importing_the_runtime_is_a_violation(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/runtime/__init__.py": "",
        "pkg/runtime/runner.py": "from pkg.kernels import ops\nfrom pkg.models import net\n",
        "pkg/models/__init__.py": "",
        "pkg/models/net.py": "from pkg.kernels.ops import op\n",
        "pkg/kernels/__init__.py": "",
        "pkg/kernels/ops.py": "def op():\n    from pkg.runtime import runner\n"
                              "    from ..models import net\n",
    })
    rules = {"kernels": ("runtime", "models"), "models": ("runtime",)}
    assert layer_violations(import_edges(package), "pkg", rules) == [
        "pkg.kernels.ops:3 -> pkg.models.net",
        "pkg.kernels.ops:2 -> pkg.runtime.runner",
    ]


def test_imports_of_the_private_regex_parser_are_found_in_every_spelling(tmp_path):
    package = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import sre_parse\n",
        "pkg/b.py": "from re import _parser\n",
        "pkg/c.py": "import re\nre._parser.parse('a')\n",
        "pkg/d.py": "import re\nre.compile('a')  # re._parser in a comment is fine\n",
    })
    assert private_regex_uses(package) == [
        "pkg.a:1 sre_parse", "pkg.b:1 re._parser", "pkg.c:2 re._parser"]


def test_relative_imports_beyond_the_package_are_refused(tmp_path):
    package = write_package(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from ... import x\n"})
    with pytest.raises(ValueError, match="beyond the top-level package"):
        import_edges(package)
