"""The target cache: transformers reads and dequantizes the GGUF file slowly; the
dequantized model, saved once as safetensors, loads many times faster.

An entry is written into a temporary directory and renamed into place, checked
against its manifest (the weights' size and SHA-256) at every load, and removed
and rebuilt when damaged; :func:`entry_lock` keeps concurrent processes from
dequantizing the same file twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

from specjax.runtime import cache_root

__all__ = ["cache_entry", "entry_lock", "load_cached_target", "save_cached_target", "target_cache_dir"]

_CACHE_MANIFEST = "specjax-cache.json"


def target_cache_dir() -> pathlib.Path | None:
    """Where :func:`load_target` keeps dequantized copies of GGUF targets, or None when off.

    specjax's cache, :func:`specjax.runtime.cache_root` (``$SPECJAX_CACHE_DIR``;
    ``off`` turns it off). An entry (``targets/<GGUF SHA-256 prefix>-<dtype>-transformers-<version>``)
    holds ``config.json``, ``model.safetensors`` (about 540 MB for the default
    target in float32), the tokenizer files and a manifest with the weights'
    SHA-256, checked at every load.
    """
    return cache_root()


def cache_entry(digest: str, torch_dtype: Any) -> pathlib.Path | None:
    root = target_cache_dir()
    if root is None:
        return None
    import transformers

    dtype = str(torch_dtype).removeprefix("torch.")
    return root / "targets" / f"{digest[:16]}-{dtype}-transformers-{transformers.__version__}"


def _warn(msg: str) -> None:
    print(f"specjax: {msg}", file=sys.stderr, flush=True)


def load_cached_target(entry: pathlib.Path, digest: str, torch_dtype: Any) -> tuple[Any, Any] | None:
    """The model and tokenizer from a cache entry, or None (absent, or corrupt: then it is removed)."""
    manifest_path = entry / _CACHE_MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        weights = entry / "model.safetensors"
        if manifest.get("gguf_sha256") != digest:
            raise ValueError("the manifest names another GGUF file")
        if weights.stat().st_size != manifest["weights_size"]:
            raise ValueError(
                f"model.safetensors has {weights.stat().st_size} bytes, expected {manifest['weights_size']}"
            )
        with weights.open("rb") as fh:
            if hashlib.file_digest(fh, "sha256").hexdigest() != manifest["weights_sha256"]:
                raise ValueError("model.safetensors: SHA-256 mismatch")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(entry))
        model = AutoModelForCausalLM.from_pretrained(str(entry), dtype=torch_dtype)
        return model, tokenizer
    except Exception as err:  # a damaged entry: say so, drop it, load from the GGUF file
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        _warn(f"the cached target in {entry} is unusable ({reason}); loading the GGUF file and caching it again")
        _remove_tree(entry)
        return None


def _remove_tree(path: pathlib.Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def save_cached_target(entry: pathlib.Path, digest: str, gguf: pathlib.Path, model: Any, tokenizer: Any) -> None:
    """Write a cache entry (into a temporary directory, renamed into place); warn and go on if it fails."""
    import tempfile

    from safetensors.torch import save_model

    tmp: pathlib.Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=entry.name + ".", dir=entry.parent))
        weights = tmp / "model.safetensors"
        save_model(model, str(weights))  # tied weights (embedding = LM head) stored once
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are dequantized
        (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        with weights.open("rb") as fh:
            weights_sha = hashlib.file_digest(fh, "sha256").hexdigest()
        manifest = {
            "gguf": gguf.name,
            "gguf_sha256": digest,
            "weights_size": weights.stat().st_size,
            "weights_sha256": weights_sha,
        }
        (tmp / _CACHE_MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        try:
            os.replace(tmp, entry)
        except OSError:
            if not (entry / _CACHE_MANIFEST).is_file():  # not another process that won the race
                raise
            _remove_tree(tmp)
        tmp = None
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        _warn(f"could not cache the dequantized target in {entry} ({reason}); the next load reads the GGUF file again")
    finally:
        if tmp is not None:
            _remove_tree(tmp)


@contextlib.contextmanager
def entry_lock(entry: pathlib.Path) -> Iterator[None]:
    """An exclusive lock on a cache entry across processes (``flock`` on ``<entry>.lock``).

    Where no lock can be taken (no ``fcntl``, an unwritable cache) it does nothing:
    concurrent misses then each read the GGUF file, as without a cache.
    """
    try:
        import fcntl

        entry.parent.mkdir(parents=True, exist_ok=True)
        fh = open(entry.parent / (entry.name + ".lock"), "a+b")
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield
    finally:
        fh.close()  # releases the lock
