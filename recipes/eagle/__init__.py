"""The EAGLE head's recipe: one core (:mod:`.core`), two backends (:mod:`.torch_backend` on a CPU or CUDA GPU,
:mod:`.jax_backend` on a TPU or any JAX device), the CPU evaluation (:mod:`.evaluate`); ``python -m
recipes.eagle --help`` (:mod:`.cli`) and recipes/README.md."""
