"""specjax: exact speculative decoding with a jitted JAX acceptance kernel.

The public API is small and imported lazily, so ``import specjax`` has no side
effects and does not start JAX or torch:

* :func:`rejection_sample` — the acceptance kernel (probabilities in).
* :func:`sample_from_logits`, :func:`verify_from_logits` — the logits front end.
* :func:`speculative_generate` — the generation loop over Hugging Face models.
* :func:`load_sampler` — resolve a sampler by name from the entry-point registry.
* :class:`AcceptanceResult` (``num_accepted``, ``tokens``), what the acceptance
  functions return; :class:`SamplingParams`, the per-row parameters the jitted
  kernels take as one pytree.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "AcceptanceResult": "specjax.kernels.results",
    "SamplingParams": "specjax.kernels.types",
    "rejection_sample": "specjax.boundary.api",
    "sample_from_logits": "specjax.boundary.api",
    "verify_from_logits": "specjax.boundary.api",
    "speculative_generate": "specjax.generate",
    "SpeculativeOutput": "specjax.generate",
    "load_sampler": "specjax.registry",
    "set_jax_cpu_threads": "specjax.runtime",
    "available_samplers": "specjax.registry",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specjax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
