"""XLA compile options shared by specjax's jitted entry points."""

from __future__ import annotations

# On XLA:CPU, let LLVM vectorise fused loops with 512-bit vectors where the CPU
# has them (AVX-512); XLA's default prefers 256 bits. The front end's passes over
# the vocabulary (the exp of the normalisers) run faster with it here
# (benchmarks/bench_overheads.py, last table); the probability kernel's time is
# not in such loops and it keeps XLA's default. A preference only: LLVM never
# uses wider vectors than the CPU has, and other backends ignore ``xla_cpu_*``
# options. Floating-point results may differ in the last bit from XLA's default
# (e.g. a normaliser), so every jitted function that turns logits into
# probabilities uses these same options: the draft's draw and the acceptance
# step must compute q identically, bit for bit. (On a single CPU device both
# take q from the C++ kernels instead, specjax.kernels.cpu_kernels, with one
# expression for a token's probability.)
VECTOR_OPTIONS: dict[str, int] = {"xla_cpu_prefer_vector_width": 512}
