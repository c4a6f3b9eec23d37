"""The boundary layer: user inputs in (lists, NumPy, JAX, torch), validated, then one jitted kernel.

Above :mod:`specjax.kernels` (pure JAX) and :mod:`specjax.adapters` (torch ↔ JAX):

* :mod:`specjax.boundary.api` — the public functions: :func:`specjax.rejection_sample`,
  :func:`specjax.sample_from_logits`, :func:`specjax.verify_from_logits` and the
  ``*_sharded`` forms that name a device mesh.
* :mod:`specjax.boundary.validation` — conversion and checks (shapes, dtypes,
  ids, keys, per-row parameters) outside jit, with messages that name the argument.

Importing this package imports nothing else.
"""
