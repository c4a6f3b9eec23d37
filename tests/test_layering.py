"""The package's import graph: no cycles, and no module imports a layer above its own.

Every module under src/specjax is parsed with :mod:`ast` (nothing is imported);
every ``import`` and ``from ... import`` counts, at module level and inside
functions alike (a function-local import is still a dependency, and hiding a
circle inside a function is what this test exists to stop), and so do the
lazy exports of packages (``_EXPORTS = {"name": "specjax.module"}``) and
``importlib.import_module("specjax....")`` with a constant name. The layers are
the ones docs/design.md ("Layers") describes. Each public name has one import
path: no module keeps a table of old paths that resolve upward.

The checker's own tests, on synthetic modules, come first: each shows it flags
what it should.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: Lowest first. A module belongs to the layer of its longest matching prefix; a
#: module may import its own layer and the ones below, never one above.
LAYERS: list[tuple[str, ...]] = [
    ("specjax.kernels", "specjax.runtime"),  # pure JAX: jax.Array in and out
    ("specjax.adapters",),  # torch <-> JAX, device and memory policy
    ("specjax.boundary",),  # user inputs in: conversion, validation, the public entry points
    (
        "specjax.registry",
        "specjax.slots",
        "specjax.packed",
        "specjax.prompts",
        "specjax.console",
    ),  # shared support
    ("specjax.drafters",),  # what proposes tokens
    ("specjax.generate",),  # the loop
    ("specjax.plugin",),  # transformers and vLLM integrations, the built-in plugin
    ("specjax.pair",),  # the embedded default model pair
    ("specjax.demo", "specjax.bench"),
    ("specjax.cli",),
    ("specjax",),  # the package's lazy public namespace
]


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    local: bool  # inside a function


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` (a module or ``module.attribute``) names."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _string_targets(node: ast.AST) -> Iterable[tuple[str, int]]:
    """Lazy imports by name: ``_EXPORTS`` dict values and ``importlib.import_module("...")``."""
    if isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and isinstance(node.value, ast.Dict):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.value, node.lineno
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "import_module" and isinstance(node.args[0].value, str):
            yield node.args[0].value, node.lineno


def imports_of(
    source: str, name: str, is_package: bool, known: set[str]
) -> tuple[list[Import], list[tuple[str, str, int]]]:
    """The specjax modules ``name`` imports, and every ``from M import N`` as (M, N, line)."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    found: list[Import] = []
    from_names: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, local: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            local = True
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, known)
                if target:
                    found.append(Import(name, target, node.lineno, local))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                target = _resolve(f"{module}.{alias.name}", known)
                if target:
                    found.append(Import(name, target, node.lineno, local))
                    from_names.append((module, alias.name, node.lineno))
        for text, line in _string_targets(node):
            target = _resolve(text, known)
            if target:
                found.append(Import(name, target, line, local))
        for child in ast.iter_child_nodes(node):
            visit(child, local)

    visit(tree, False)
    return [i for i in found if i.target != name], from_names


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int:
    best, best_len = None, -1
    for index, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module}: in no layer; add it to LAYERS (and to docs/design.md, 'Layers')")
    return best


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def upward(found: Iterable[Import], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    return [
        f"{i.source}:{i.line} imports {i.target}{' (inside a function)' if i.local else ''}, a higher layer"
        for i in found
        if layer_of(i.target, layers) > layer_of(i.source, layers)
    ]


@dataclass
class Graph:
    imports: list[Import]
    from_names: dict[str, list[tuple[str, str, int]]]

    def edges(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for i in self.imports:
            out.setdefault(i.source, set()).add(i.target)
        return out


def build(sources: Mapping[str, tuple[str, bool]]) -> Graph:
    """``sources``: module name -> (source text, is a package)."""
    known = set(sources)
    imports: list[Import] = []
    from_names: dict[str, list[tuple[str, str, int]]] = {}
    for name, (text, is_package) in sources.items():
        found, names = imports_of(text, name, is_package, known)
        imports += found
        from_names[name] = names
    return Graph(imports, from_names)


def package_sources() -> dict[str, tuple[str, bool]]:
    out = {}
    for path in sorted((SRC / "specjax").rglob("*.py")):
        name, is_package = module_name(path, SRC)
        out[name] = (path.read_text(encoding="utf-8"), is_package)
    return out


# --------------------------------------------------------------------------- the checker


def test_checker_flags_a_cycle_hidden_in_a_function() -> None:
    graph = build(
        {
            "pkg": ("", True),
            "pkg.a": ("from pkg.b import f\n", False),
            "pkg.b": ("def f():\n    from pkg import a\n    return a\n", False),
            "pkg.c": ("import pkg.a\n", False),
        }
    )
    assert cycles(graph.edges()) == [["pkg.a", "pkg.b"]]
    assert [i for i in graph.imports if i.source == "pkg.b"] == [Import("pkg.b", "pkg.a", 2, True)]


def test_checker_flags_an_upward_import_and_accepts_downward_ones() -> None:
    layers = [("pkg.low",), ("pkg.high",), ("pkg",)]
    graph = build(
        {
            "pkg": ('_EXPORTS = {"f": "pkg.high"}\n', True),
            "pkg.low": ("import importlib\ndef g():\n    return importlib.import_module('pkg.high')\n", False),
            "pkg.high": ("from .low import x\n", False),
        }
    )
    assert upward(graph.imports, layers) == ["pkg.low:3 imports pkg.high (inside a function), a higher layer"]
    assert cycles(graph.edges()) == [["pkg.high", "pkg.low"]]


def test_every_module_is_in_a_layer() -> None:
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("elsewhere.module")
    for name in package_sources():
        layer_of(name)


# --------------------------------------------------------------------------- the package

GRAPH = build(package_sources())


def test_no_import_cycles() -> None:
    assert cycles(GRAPH.edges()) == []


def test_no_import_of_a_higher_layer() -> None:
    assert upward(GRAPH.imports) == []


def test_one_path_per_public_name() -> None:
    """No module keeps old import paths: no ``_MOVED`` table, and a module ``__getattr__`` only for a
    package's lazy namespace of its own public names (``_EXPORTS``, which the graph counts as imports)."""
    doors = []
    for name, (text, _) in package_sources().items():
        assigned = {
            t.id
            for n in ast.parse(text).body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        getattr_ = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(text).body)
        if "_MOVED" in assigned or (getattr_ and "_EXPORTS" not in assigned):
            doors.append(name)
    assert doors == []


#: Modules that must re-export a name from elsewhere: transformers loads a ``custom_generate``
#: repository's ``generate`` from its own ``custom_generate/generate.py``.
REEXPORTS_REQUIRED_BY_OTHERS = {"specjax.plugin.specjax_speculative_decoding.custom_generate.generate"}


def reexports(sources: Mapping[str, tuple[str, bool]]) -> list[str]:
    """Names a module lists in ``__all__`` after importing them from a specjax module outside its own
    package: a second import path for a name that lives elsewhere (the package ``specjax`` itself is the
    public namespace and re-exports lazily through ``_EXPORTS``)."""
    out = []
    for name, (text, is_package) in sources.items():
        home = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(text)
        imported = {
            alias.asname or alias.name: node.module
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and not node.level and node.module
            for alias in node.names
        }
        exported = [
            elt.value
            for node in tree.body
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for elt in getattr(node.value, "elts", [])
            if isinstance(elt, ast.Constant) and isinstance(elt.value, str)
        ]
        for export in exported:
            module = imported.get(export, "")
            if module.split(".")[0] == name.split(".")[0] and module != home and not module.startswith(home + "."):
                out.append(f"{name} re-exports {export} from {module}")
    return out


def test_checker_flags_a_reexport_from_another_package() -> None:
    flagged = reexports(
        {
            "pkg.shared": ("X = 1\n", False),
            "pkg.sub": ('from pkg.sub.own import Y\nfrom pkg.shared import X\n__all__ = ["X", "Y"]\n', True),
            "pkg.sub.own": ("Y = 1\n", False),
            "pkg.sub.alias": ('from pkg.shared import X\n__all__ = ["X"]\n', False),
            "pkg.sub.user": ('from pkg.shared import X\n__all__ = ["f"]\ndef f():\n    return X\n', False),
        }
    )
    assert flagged == ["pkg.sub re-exports X from pkg.shared", "pkg.sub.alias re-exports X from pkg.shared"]


def test_no_module_reexports_another_packages_names() -> None:
    """One import path per name: e.g. the registry's names only at ``specjax.registry`` (no
    ``specjax.plugin.registry``, no ``specjax.plugin.register_sampler``)."""
    sources = {k: v for k, v in package_sources().items() if k not in REEXPORTS_REQUIRED_BY_OTHERS}
    assert reexports(sources) == []


def test_kernels_import_neither_torch_nor_adapters() -> None:
    """kernels/: JAX arrays in and out (the adapters and the boundary do the conversions)."""
    offenders = []
    for name, (text, _) in package_sources().items():
        if layer_of(name) > layer_of("specjax.kernels"):
            continue
        for node in ast.walk(ast.parse(text)):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{name}:{node.lineno} imports {m}" for m in modules if m.split(".")[0] == "torch"]
    assert offenders == []
