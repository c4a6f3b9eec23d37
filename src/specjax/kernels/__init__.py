"""Pure JAX kernels: the acceptance kernel, the logits front end, validation."""

from specjax.kernels.rejection import rejection_sample

__all__ = ["rejection_sample"]
