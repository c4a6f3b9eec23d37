"""The release: ``python -m build`` makes an sdist and, from it, a wheel; what they carry and how it loads.

* the wheel holds exactly the files of ``src/specjax`` plus the prebuilt C++ CPU
  kernels (one per target ``cpu_kernels.target_flags`` can pick) and their
  manifest: the shipped assets, nothing from tests/, benchmarks/, scripts/ or
  recipes/;
* specjax loads the prebuilt library first, with no compiler around; a
  library built for another jaxlib, another source or another target is not
  used, and one that does not load falls back to a build on first use, then to
  the JAX code with a warning that gives both reasons (fresh processes).

The build copies the checkout's files (tracked and untracked, not ignored: a
clean clone's) into a temporary folder, so that it never writes into this one.
``make test-wheel`` installs such a wheel into a fresh venv and runs the demo
and the README's example from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import jaxlib
import pytest

import specjax
from specjax.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
PREBUILT = "specjax/kernels/prebuilt/"
LAB = ("tests/", "benchmarks/", "scripts/", "recipes/", "integration_tests/", "vllm_tests/", "docs/")


def _checkout_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    return [name for name in listed.stdout.decode().split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """``{"sdist": path, "wheel": path}``, built by ``python -m build`` from a copy of the checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (its file list)")
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("dist")
    for name in _checkout_files():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.fixture(scope="module")
def prebuilt(dist, tmp_path_factory) -> Path:
    """The wheel's prebuilt/ folder, extracted."""
    out = tmp_path_factory.mktemp("wheel")
    with zipfile.ZipFile(dist["wheel"]) as whl:
        whl.extractall(out, [n for n in whl.namelist() if n.startswith(PREBUILT)])
    return out / PREBUILT


def test_the_wheel_holds_the_package_and_its_prebuilt_kernels_only(dist):
    version = specjax.__version__
    assert dist["wheel"].name == f"specjax-{version}-py3-none-{_platform_tag()}.whl"
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = whl.namelist()
        manifest = json.loads(whl.read(PREBUILT + "manifest.json"))
    package = {n for n in names if not n.startswith(f"specjax-{version}.dist-info/")}
    shipped = {n.removeprefix("src/") for n in _checkout_files() if n.startswith("src/specjax/")}
    libraries = {PREBUILT + name for name in manifest["libraries"].values()}
    assert package == shipped | libraries | {PREBUILT + "manifest.json"}
    assert any(n.startswith("specjax/assets/smollm2-draft/") for n in package)
    assert any(n.startswith("specjax/assets/smollm2-eagle/") for n in package)
    assert not [n for n in names if n.startswith(LAB) or any(f"/{lab}" in n for lab in LAB)]
    assert manifest["jaxlib"] == jaxlib.__version__
    assert manifest["source_sha256"] == hashlib.sha256(cpu_kernels._SOURCE.read_bytes()).hexdigest()


def test_the_sdist_builds_the_kernels_and_ships_no_lab_code(dist):
    with tarfile.open(dist["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "README.md", "src/specjax/kernels/cpu_kernels.cc"} <= names
    assert not [n for n in names if n.startswith(LAB)]


def _platform_tag() -> str:
    import sysconfig

    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


# A CPU that has each x86-64 psABI level's features (cumulative), and none.
X86_CPUS = [set()] + [set().union(*(needs for _, needs in cpu_kernels._X86_LEVELS[i:])) for i in reversed(range(3))]


def test_every_target_a_cpu_can_pick_has_a_prebuilt_library(prebuilt, monkeypatch):
    """The manifest is keyed by the full flags of the build cpu_kernels would run on that CPU."""
    monkeypatch.delenv("SPECJAX_CPU_NATIVE", raising=False)
    libraries = json.loads((prebuilt / "manifest.json").read_text())["libraries"]
    cpus = X86_CPUS if platform.machine().lower() in ("x86_64", "amd64") else [set()]
    wanted = set()
    for features in cpus:
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda features=features: features)
        wanted.add(" ".join((*cpu_kernels._FLAGS, *cpu_kernels.target_flags())))
    assert len(wanted) == len(cpus)
    assert set(libraries) == wanted
    assert all((prebuilt / name).is_file() for name in libraries.values())


def _variant(prebuilt: Path, tmp_path: Path, edit) -> Path:
    """A copy of the prebuilt folder whose manifest ``edit`` changed in place."""
    copy = Path(shutil.copytree(prebuilt, tmp_path / "prebuilt"))
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest, copy)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _other_jaxlib(m, _):
    m["jaxlib"] = "0.0.1"


def _other_source(m, _):
    m["source_sha256"] = "0" * 64


def _other_machine(m, _):
    m["machine"] = "riscv64"


def _no_build_for_this_cpu(m, _):
    del m["libraries"][" ".join((*cpu_kernels._FLAGS, *cpu_kernels.target_flags()))]


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (_other_jaxlib, f"the prebuilt library was built for jaxlib 0.0.1, this is jaxlib {jaxlib.__version__}"),
        (_other_source, "the prebuilt library was built from another cpu_kernels.cc"),
        (_other_machine, f"the prebuilt library was built for riscv64, this is {platform.machine()}"),
        (_no_build_for_this_cpu, "the prebuilt library has no build for "),
    ],
)
def test_a_prebuilt_library_for_something_else_is_not_used(prebuilt, tmp_path, monkeypatch, edit, why):
    monkeypatch.setattr(cpu_kernels, "_PREBUILT", prebuilt)
    path, unusable = cpu_kernels._prebuilt()
    assert unusable is None and path is not None and path.parent == prebuilt
    monkeypatch.setattr(cpu_kernels, "_PREBUILT", _variant(prebuilt, tmp_path, edit))
    path, unusable = cpu_kernels._prebuilt()
    assert path is None
    assert unusable is not None and unusable.startswith(why)


def test_a_source_tree_has_no_prebuilt_library(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_PREBUILT", tmp_path / "prebuilt")
    assert cpu_kernels._prebuilt() == (None, None)


PROBE = """
    import sys, warnings, numpy as np, jax, specjax
    from pathlib import Path
    from specjax.kernels import cpu_kernels
    cpu_kernels._PREBUILT = Path(sys.argv[1])
    x = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = specjax.sample_from_logits(x, key=jax.random.key(0), temperature=0.8)[1]
    reference = specjax.sample_from_logits(x, key=jax.random.key(0), temperature=0.8, impl="xla")[1]
    print(cpu_kernels.available(), np.allclose(ours, reference, rtol=2e-6, atol=1e-9),
          sum("C++ CPU kernels" in str(w.message) for w in caught), cpu_kernels.library_path(),
          cpu_kernels.build_error())
"""


def _probe(prebuilt: Path, tmp_path: Path, compiler: bool) -> tuple[str, str, str, str, str]:
    env = {**os.environ, "SPECJAX_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("SPECJAX_CPU_NATIVE", None)
    if not compiler:  # no $CXX, no g++ or c++ on PATH (the interpreter is called by its full path)
        env.update(CXX=str(tmp_path / "no-such-compiler"), PATH=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE), str(prebuilt)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    available, agrees, warned, path, reason = proc.stdout.strip().split(" ", 4)
    return available, agrees, warned, path, reason


def _garbage(_, folder):
    for library in folder.glob("*.so"):
        library.write_bytes(b"not a shared library")


def test_the_prebuilt_library_runs_without_a_compiler(prebuilt, tmp_path):
    available, agrees, warned, path, _ = _probe(prebuilt, tmp_path, compiler=False)
    assert (available, agrees, warned) == ("True", "True", "0")
    assert Path(path).parent == prebuilt


def test_a_prebuilt_library_that_does_not_load_falls_back_to_a_build(prebuilt, tmp_path):
    if cpu_kernels._compiler() is None:
        pytest.skip("no C++ compiler")
    available, agrees, warned, path, _ = _probe(_variant(prebuilt, tmp_path, _garbage), tmp_path, compiler=True)
    assert (available, agrees, warned) == ("True", "True", "0")
    assert Path(path).is_relative_to(tmp_path / "cache")


def test_without_a_loadable_library_or_a_compiler_the_jax_code_runs_with_both_reasons(prebuilt, tmp_path):
    available, agrees, warned, path, reason = _probe(_variant(prebuilt, tmp_path, _garbage), tmp_path, compiler=False)
    assert (available, agrees, warned, path) == ("False", "True", "1", "None")
    assert reason.startswith("the prebuilt library did not load (")
    assert reason.endswith("; no C++ compiler found ($CXX, g++ or c++)")
