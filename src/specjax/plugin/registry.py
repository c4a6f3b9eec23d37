"""The sampler and plugin registry, at its old path: :mod:`specjax.registry` is the module.

It moved below the drafters and the generation loop (which look samplers and
the ``SPECJAX_PLUGINS`` filter up there); plugins keep importing
``register_sampler`` and friends from here.
"""

from __future__ import annotations

from specjax.registry import (
    BUILTIN_SAMPLERS,
    ENV_VAR,
    PLUGINS_GROUP,
    SAMPLERS_GROUP,
    PluginInfo,
    allowed_names,
    available_custom_generates,
    available_samplers,
    load_custom_generate,
    load_plugins,
    load_plugins_by_group,
    load_sampler,
    plugin_status,
    register_custom_generate,
    register_sampler,
    sampler_origins,
)

__all__ = [
    "BUILTIN_SAMPLERS",
    "ENV_VAR",
    "PLUGINS_GROUP",
    "SAMPLERS_GROUP",
    "PluginInfo",
    "allowed_names",
    "available_custom_generates",
    "available_samplers",
    "load_custom_generate",
    "load_plugins",
    "load_plugins_by_group",
    "load_sampler",
    "plugin_status",
    "register_custom_generate",
    "register_sampler",
    "sampler_origins",
]
