"""specjax's wheel build step: the C++ CPU kernels, compiled into the package.

pyproject.toml holds everything else. This adds one step to ``build_py``:
compile ``src/specjax/kernels/cpu_kernels.cc`` with the system C++ compiler
(``$CXX``, else ``g++``/``c++``) against the FFI headers of the build
environment's jaxlib, once for every target that
:func:`specjax.kernels.cpu_kernels.target_flags` can pick at run time (on
x86-64 each psABI level: never ``-march=native``; elsewhere the compiler's
default), into ``specjax/kernels/prebuilt/`` beside a ``manifest.json`` that
says which jaxlib, source and flags each library was built for. At run time
cpu_kernels loads the library whose flags it would build with, if the manifest
matches the installed jaxlib and the shipped source; otherwise it builds one on
first use, or runs the JAX code and says why.

Without a compiler, or when a build fails, the wheel is pure Python (no
prebuilt library) and still works the same way. The build flags and the target
rule are read from ``cpu_kernels.py`` itself (its ``_FLAGS``, ``_X86_LEVELS``
and ``target_flags``), so they are written once. Editable installs build
nothing here (the Makefile's install step builds into specjax's cache).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

KERNELS = Path(__file__).resolve().parent / "src" / "specjax" / "kernels"
SOURCE = KERNELS / "cpu_kernels.cc"
PREBUILT = ("specjax", "kernels", "prebuilt")  # inside the package: cpu_kernels._PREBUILT
_RECIPE = ("_FLAGS", "_X86_LEVELS", "_cpu_flags", "target_flags")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def _recipe() -> dict:
    """The flags and target rule of cpu_kernels.py, executed from its own source (it imports JAX)."""
    tree = ast.parse((KERNELS / "cpu_kernels.py").read_text())
    nodes: list[ast.stmt] = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in _RECIPE)
        or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in _RECIPE for t in node.targets))
    ]
    namespace: dict = {"os": os}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "cpu_kernels.py", "exec"), namespace)
    missing = [name for name in _RECIPE if name not in namespace]
    if missing:
        raise RuntimeError(f"setup.py: cpu_kernels.py no longer defines {', '.join(missing)}")
    return namespace


def targets() -> dict[str, tuple[str, ...]]:
    """Every build ``cpu_kernels`` can ask for here: ``{file stem: full flags}``, one per x86-64 level."""
    recipe = _recipe()
    # Each CPU a level's features describe (the baseline has none); cumulative, lowest first.
    cpus: list[tuple[str, set[str]]] = [("x86-64", set())]
    for name, needs in reversed(recipe["_X86_LEVELS"]):
        cpus.append((name, cpus[-1][1] | needs))
    native = os.environ.pop("SPECJAX_CPU_NATIVE", None)  # a wheel never assumes the build machine's CPU
    try:
        found: dict[str, tuple[str, ...]] = {}
        for name, features in cpus:
            recipe["_cpu_flags"] = lambda features=features: features
            flags = (*recipe["_FLAGS"], *recipe["target_flags"]())
            if "-march=native" in flags:
                raise RuntimeError("setup.py: target_flags() asked for -march=native")
            stem = name if any(f.startswith("-march=") for f in flags) else platform.machine().lower()
            found.setdefault(stem, flags)
    finally:
        if native is not None:
            os.environ["SPECJAX_CPU_NATIVE"] = native
    return found


def build_kernels(out_dir: Path) -> None:
    """Compile the kernels for every target into ``out_dir``, with their manifest; warns and skips on failure."""
    compiler = _compiler()
    if compiler is None:
        print("specjax: no C++ compiler ($CXX, g++ or c++): the wheel has no prebuilt CPU kernels", file=sys.stderr)
        return
    import jax
    import jaxlib

    out_dir.mkdir(parents=True, exist_ok=True)
    include = f"-I{jax.ffi.include_dir()}"

    def one(item: tuple[str, tuple[str, ...]]) -> tuple[str, str, str | None]:
        stem, flags = item
        name = f"libspecjax_cpu-{stem}.so"
        cmd = [compiler, *flags, include, str(SOURCE), "-o", str(out_dir / name)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        return " ".join(flags), name, None if proc.returncode == 0 else f"{' '.join(cmd)}: {proc.stderr[-2000:]}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        built = list(pool.map(one, targets().items()))
    failed = [error for _, _, error in built if error]
    if failed:
        shutil.rmtree(out_dir)
        print("specjax: the CPU kernels did not build; the wheel has none:\n" + "\n".join(failed), file=sys.stderr)
        return
    manifest = {
        "jaxlib": jaxlib.__version__,
        "machine": platform.machine(),
        "source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "libraries": {flags: name for flags, name, _ in built},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            build_kernels(Path(self.build_lib, *PREBUILT))


class BinaryDistribution(Distribution):
    """With a compiler, the wheel carries the kernels: a platform wheel, installed to platlib."""

    def has_ext_modules(self) -> bool:
        return _compiler() is not None


class BdistWheel(bdist_wheel):
    """``py3-none-<platform>``: the kernels depend on the platform and jaxlib, not on a Python ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
