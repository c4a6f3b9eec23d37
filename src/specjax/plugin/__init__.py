"""Plugins, the sampler registry and the transformers drop-ins.

* :func:`load_plugins` — run every installed ``specjax.plugins`` entry point's
  ``register()`` once per process (``SPECJAX_PLUGINS`` filters by name).
* :func:`load_sampler`, :func:`available_samplers`, :func:`register_sampler` —
  samplers with the :func:`specjax.rejection_sample` contract, by name.
* :func:`load_custom_generate`, :func:`register_custom_generate` — transformers
  ``custom_generate`` callables by name.
* :mod:`specjax.plugin.hf` — ``speculative_decoding`` for
  ``generate(custom_generate=...)`` and ``patch_speculative_sampling()``.
* :mod:`specjax.plugin.reference_samplers` — the ``numpy`` and ``torch`` samplers.

Importing this package imports neither JAX, torch nor transformers and
registers nothing. See docs/plugins.md.
"""

from __future__ import annotations

from specjax.registry import (
    ENV_VAR,
    PLUGINS_GROUP,
    SAMPLERS_GROUP,
    PluginInfo,
    available_custom_generates,
    available_samplers,
    load_custom_generate,
    load_plugins,
    load_sampler,
    plugin_status,
    register_custom_generate,
    register_sampler,
    sampler_origins,
)

__all__ = [
    "ENV_VAR",
    "PLUGINS_GROUP",
    "SAMPLERS_GROUP",
    "PluginInfo",
    "available_custom_generates",
    "available_samplers",
    "load_custom_generate",
    "load_plugins",
    "load_sampler",
    "plugin_status",
    "register_custom_generate",
    "register_sampler",
    "sampler_origins",
]
