"""Plugins: the transformers drop-ins, the built-in samplers' plugin, vLLM.

* :mod:`specjax.plugin.hf` — ``speculative_decoding`` for
  ``generate(custom_generate=...)`` and ``patch_speculative_sampling()``.
* :mod:`specjax.plugin.builtin` — the ``builtin_samplers`` plugin.
* :mod:`specjax.plugin.reference_samplers` — the ``numpy`` and ``torch`` samplers.
* :mod:`specjax.plugin.vllm` — the vLLM plugin.

The registry these plugins register with (:func:`~specjax.registry.load_plugins`,
:func:`~specjax.registry.register_sampler`, :func:`~specjax.registry.load_sampler`,
...) is :mod:`specjax.registry`. Importing this package imports neither JAX,
torch nor transformers and registers nothing. See docs/plugins.md.
"""
