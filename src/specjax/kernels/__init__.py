"""Pure JAX kernels: JAX arrays in and out; no torch, no adapters, no input conversion.

* :mod:`specjax.kernels.types`: :class:`SamplingParams` (the per-row sampling
  parameters, one pytree, modes static) and the pytree registration of
  :class:`~specjax.kernels.results.AcceptanceResult` (``num_accepted``,
  ``tokens``; defined without JAX in :mod:`specjax.kernels.results`).
* :mod:`specjax.kernels.core`: the acceptance core, the primitives every
  kernel is composed of, each written once with an optional mesh axis.
* :mod:`specjax.kernels.rejection`: the acceptance kernel (probabilities in)
  and the vocabulary of terms.
* :mod:`specjax.kernels.frontend`: logits processing and the acceptance step
  from logits.
* :mod:`specjax.kernels.sharded`: the kernels on a device mesh (``shard_map``).
* :mod:`specjax.kernels.steps`: the generation loop's jitted steps.
* :mod:`specjax.kernels.cpu_kernels`: the optional C++ CPU kernels.

The public functions that take user inputs (lists, NumPy, torch) live in
:mod:`specjax.boundary.api`, above this package.
"""

from __future__ import annotations
