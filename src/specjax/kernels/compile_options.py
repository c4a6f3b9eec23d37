"""XLA compile options shared by specjax's jitted entry points."""

from __future__ import annotations

# On XLA:CPU, let LLVM vectorise fused loops with 512-bit vectors where the CPU
# has them (AVX-512); XLA's default prefers 256 bits. The front end's passes over
# the vocabulary (the exp of the normalisers, the value checks' maxima) are
# 8-15 % faster with it here (docs/benchmarks.md, logits section); the
# acceptance kernel's time is not in such loops and does not change. It is a
# preference only: LLVM never uses wider vectors than the CPU has, and other
# backends ignore ``xla_cpu_*`` options. Results are the same bits.
VECTOR_OPTIONS: dict[str, int] = {"xla_cpu_prefer_vector_width": 512}
