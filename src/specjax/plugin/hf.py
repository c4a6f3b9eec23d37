"""The ``transformers`` plugin: two drop-ins that give an unmodified ``model.generate`` call specjax's sampling.

1. **custom_generate** — ``target.generate(input_ids, draft_model=draft,
   custom_generate=speculative_decoding, ...)``, or with ``assistant_model=draft``
   and ``custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True``, runs
   specjax's loop inside ``generate`` (:mod:`specjax.plugin.custom_generate`).
2. **patch** — ``with patch_speculative_sampling(): target.generate(...,
   assistant_model=draft, do_sample=True)`` keeps transformers' assisted loop
   and replaces only its acceptance step (:mod:`specjax.plugin.sampling_patch`).

This module is the ``transformers`` entry point (:func:`register`, which
registers :func:`speculative_decoding` as the ``custom_generate`` name
``"specjax"``: ``specjax.registry.load_custom_generate("specjax")``) and the
import path of both drop-ins. Importing it imports neither torch, JAX nor
transformers and changes nothing.
"""

from __future__ import annotations

from specjax.plugin.custom_generate import CUSTOM_GENERATE_DIR, speculative_decoding
from specjax.plugin.sampling_patch import (
    PatchStats,
    check_transformers_compatibility,
    jax_speculative_sampling,
    patch_speculative_sampling,
)
from specjax.registry import register_custom_generate

__all__ = [
    "CUSTOM_GENERATE_DIR",
    "PatchStats",
    "check_transformers_compatibility",
    "jax_speculative_sampling",
    "patch_speculative_sampling",
    "register",
    "speculative_decoding",
]


def register() -> None:
    """The ``transformers`` plugin: register ``custom_generate`` ``"specjax"`` (imports nothing)."""
    register_custom_generate("specjax", "specjax.plugin.custom_generate:speculative_decoding")
