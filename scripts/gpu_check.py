"""GPU check for the torch ↔ JAX adapters and the kernels (run by ``make gpu-check``).

Prints one PASS/FAIL line per check and one timing line per batch size; exits 1
on any FAIL. Without a CUDA GPU it prints "no CUDA GPU: skipped" and exits 0.
Installs nothing and needs no network; takes well under 5 minutes on one GPU.

Checks, for B in {1, 64, 256}, G = 4, V = 128256:
  * torch CUDA logits/probabilities reach JAX without a copy (same device pointer);
  * rejection_sample (probabilities = torch softmax of the logits) and, when it
    exists, verify_from_logits run on the GPU (the result's .devices());
  * tokens come back as a CUDA int32 torch tensor without a copy (to_torch);
  * the results equal the same jitted kernels run on JAX's CPU device.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from specjax.adapters import configure_jax_memory

configure_jax_memory()  # before anything starts JAX: no preallocation beside torch

import torch  # noqa: E402

if not torch.cuda.is_available():
    print("gpu_check: no CUDA GPU: skipped (torch.cuda.is_available() is False)")
    sys.exit(0)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.adapters import copy_stats, to_jax, to_torch  # noqa: E402

G, V, SIZES, REPEATS = 4, 128256, (1, 64, 256), 20
failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""), flush=True)
    if not ok:
        failures.append(name)
    return ok


def on_gpu(result: Any) -> bool:
    return all(d.platform == "gpu" for x in jax.tree.leaves(result) for d in x.devices())


def same(a: Any, b: Any) -> tuple[bool, str]:
    """Two AcceptanceResults, field by field."""
    bad = {k: int(np.sum(np.asarray(v) != np.asarray(getattr(b, k)))) for k, v in vars(a).items()}
    return not any(bad.values()), f"mismatched entries per output: {bad}"


def inputs(b: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    dev = torch.device("cuda", torch.cuda.current_device())
    draft_logits = torch.randn(b, G, V, device=dev, generator=gen)
    target_logits = torch.randn(b, G + 1, V, device=dev, generator=gen)
    target_logits[:, :G] = draft_logits + 0.5 * target_logits[:, :G]  # a draft that often agrees
    draft_probs = torch.softmax(draft_logits, dim=-1)
    flat = draft_probs.reshape(b * G, V)
    tokens = torch.multinomial(flat, 1, generator=gen).reshape(b, G).to(torch.int32)
    return {
        "draft_tokens": tokens,
        "draft_logits": draft_logits,
        "target_logits": target_logits,
        "draft_probs": draft_probs,
        "target_probs": torch.softmax(target_logits, dim=-1),
        "accept_uniforms": torch.rand(b, G, device=dev, generator=gen),
        "sample_uniforms": torch.rand(b, device=dev, generator=gen),
    }


PROB_ARGS = ("draft_tokens", "draft_probs", "target_probs", "accept_uniforms", "sample_uniforms")


def run_size(b: int, cpu: jax.Device, gen: torch.Generator) -> None:
    t = inputs(b, gen)
    torch.cuda.synchronize()
    before = copy_stats().copies
    j = {k: to_jax(v) for k, v in t.items()}
    zero = all(j[k].unsafe_buffer_pointer() == t[k].data_ptr() for k in j)
    check(
        f"B={b}: torch CUDA logits/probs reach JAX without a copy (same device pointer)",
        zero and copy_stats().copies == before,
        f"{copy_stats().copies - before} adapter copies",
    )
    want = [d for d in jax.devices("gpu") if d.local_hardware_id == torch.cuda.current_device()]
    check(
        f"B={b}: imported arrays live on JAX's GPU with CUDA index {torch.cuda.current_device()}",
        bool(want) and all(a.devices() == set(want) for a in j.values()),
        str(want),
    )

    out = specjax.rejection_sample(*(j[k] for k in PROB_ARGS), validate=False)
    check(f"B={b}: rejection_sample runs on the GPU", on_gpu(out), str(out.tokens.devices()))
    tokens = to_torch(out.tokens)
    check(
        f"B={b}: tokens return as a CUDA int32 torch tensor without a copy",
        tokens.is_cuda and tokens.dtype == torch.int32 and tokens.data_ptr() == out.tokens.unsafe_buffer_pointer(),
        f"{tokens.device}, {tokens.dtype}",
    )
    out_cpu = specjax.rejection_sample(*(jax.device_put(j[k], cpu) for k in PROB_ARGS), validate=False)
    check(f"B={b}: rejection_sample GPU result equals CPU result", *same(out, out_cpu))

    if hasattr(specjax, "verify_from_logits"):
        key = jax.random.key(b)
        args = (j["draft_tokens"], j["draft_logits"], j["target_logits"])
        vout = specjax.verify_from_logits(*args, key=key, temperature=1.0, validate=False)
        check(f"B={b}: verify_from_logits runs on the GPU", on_gpu(vout), str(vout.tokens.devices()))
        vcpu = specjax.verify_from_logits(
            *(jax.device_put(a, cpu) for a in args), key=jax.device_put(key, cpu), temperature=1.0, validate=False
        )
        check(f"B={b}: verify_from_logits GPU result equals CPU result", *same(vout, vcpu))
    else:
        print(f"SKIP  B={b}: specjax.verify_from_logits does not exist yet")

    def step() -> torch.Tensor:  # the crossing the generation loop pays, both ways
        arrays = [to_jax(t[k]) for k in PROB_ARGS]
        return to_torch(specjax.rejection_sample(*arrays, validate=False).tokens)

    def kernel_only() -> jax.Array:
        return specjax.rejection_sample(*(j[k] for k in PROB_ARGS), validate=False).tokens

    times = {}
    for name, fn, wait in (
        ("with adapters", step, lambda r: torch.cuda.synchronize()),
        ("kernel alone", kernel_only, jax.block_until_ready),
    ):
        for _ in range(3):
            wait(fn())
        samples = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            wait(fn())
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples) * 1e3
    print(
        f"TIME  B={b:>3} G={G} V={V}: median of {REPEATS}: "
        f"{times['with adapters']:.3f} ms with to_jax+to_torch, {times['kernel alone']:.3f} ms "
        f"kernel alone (ratio {times['with adapters'] / times['kernel alone']:.2f})",
        flush=True,
    )


def main() -> int:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as err:
        check("JAX has a GPU backend (install a CUDA build of JAX, see docs/gpu.md)", False, str(err))
        return 1
    cpu = jax.devices("cpu")[0]
    print(f"gpu_check: torch {torch.__version__} on {torch.cuda.get_device_name()}, jax {jax.__version__} on {gpus}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b in SIZES:
        run_size(b, cpu, gen)
        torch.cuda.empty_cache()
    print(f"gpu_check: {len(failures)} FAIL" + (f": {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
