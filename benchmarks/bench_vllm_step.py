"""vLLM's rejection step alone: vLLM's ``rejection_sample`` vs specjax's (the plugin's), same inputs.

Runs in the vLLM environment (``make install-vllm``); no engine, no model::

    LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python benchmarks/bench_vllm_step.py

Inputs as vLLM passes them with n-gram drafts: flattened draft tokens
(``num_speculative_tokens`` per request, ``--ragged`` for uneven counts),
``draft_probs=None``, target logits f32[T, V] already processed by vLLM
(divided by the temperature for sampled rows), the bonus tokens and a
``SamplingMetadata`` with one generator per request. A draft token is the
target's argmax with probability ``--agreement`` (n-gram drafts in text are
right about that often), so rows accept a few tokens. The two functions
alternate call by call; the table gives medians and the ratio (> 1: specjax's
step is faster). The load average is printed with the results.

``--impl xla`` runs the plugin's JAX code instead of the C++ CPU kernels that
``"auto"`` picks (the plugin resolves ``"auto"`` once; this sets
``SPECJAX_CPU_KERNELS=0`` before specjax loads): what the C++ path buys the
plugin's step (docs/design.md). Each process times one impl; alternate runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_io import append_jsonl, run_info


def inputs(batch: int, k: int, vocab: int, temperature: float, agreement: float, ragged: bool, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ks = [int(x) for x in torch.randint(0, k + 1, (batch,), generator=g)] if ragged else [k] * batch
    t = sum(ks)
    logits = torch.randn(t, vocab, generator=g) * 4
    if temperature > 0:
        logits = logits / temperature
    top = logits.argmax(-1).to(torch.int32)
    other = torch.randint(0, vocab, (t,), generator=g, dtype=torch.int32)
    draft = torch.where(torch.rand(t, generator=g) < agreement, top, other)
    bonus = torch.randint(0, vocab, (batch, 1), generator=g, dtype=torch.int32)
    cu = torch.tensor(ks, dtype=torch.int32).cumsum(0).to(torch.int32)
    meta = SimpleNamespace(
        temperature=None if temperature == 0 else torch.full((batch,), temperature),
        all_greedy=temperature == 0,
        all_random=temperature > 0,
        generators={b: torch.Generator().manual_seed(seed + b) for b in range(batch)},
        top_k=None,
        top_p=None,
    )
    return (draft, ks, max(ks), cu, None, logits, bonus, meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--agreement", type=float, default=0.6)
    parser.add_argument("--ragged", action="store_true", help="0..k draft tokens per request")
    parser.add_argument("--calls", type=int, default=60, help="timed calls per function and configuration")
    parser.add_argument("--jsonl", metavar="PATH", help="append one JSON row per configuration to PATH")
    parser.add_argument("--impl", choices=("auto", "xla"), default="auto", help="the plugin kernels' code")
    args = parser.parse_args()
    if args.impl == "xla":
        os.environ["SPECJAX_CPU_KERNELS"] = "0"  # before specjax loads: "auto" resolves to the JAX code

    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as vllm_rs

    # What vLLM's CPU worker does at start: its C++ stand-ins for the Triton kernels.
    current_platform.register_triton_kernel_overrides()

    import specjax.plugin.vllm as plugin
    from specjax.kernels import cpu_kernels

    theirs, ours = vllm_rs.rejection_sample, plugin.rejection_sample
    assert theirs is not ours, "vLLM's function was replaced: run without registering the plugin"
    impl = cpu_kernels.resolve("auto")
    print(
        f"# {run_info()['loadavg']} (load average before)  vocab {args.vocab}  k {args.num_speculative_tokens}  "
        f"specjax impl={impl!r}"
    )
    print("| B | T | vLLM µs | specjax µs | vLLM / specjax | same greedy tokens |")
    print("|---:|---:|---:|---:|---:|---|")
    rows = []
    for temperature in args.temperatures:
        for batch in args.batch_sizes:
            a = inputs(batch, args.num_speculative_tokens, args.vocab, temperature, args.agreement, args.ragged, 0)
            same = None
            if temperature == 0:
                same = bool((theirs(*a) == ours(*a)).all())
            for _ in range(5):  # warm-up: compiles, buffers
                theirs(*a)
                ours(*a)
            times: dict[str, list[float]] = {"vllm": [], "specjax": []}
            for _ in range(args.calls):
                for name, fn in (("vllm", theirs), ("specjax", ours)):
                    t0 = time.perf_counter()
                    fn(*a)
                    times[name].append(time.perf_counter() - t0)
            v, s = (statistics.median(times[n]) * 1e6 for n in ("vllm", "specjax"))
            print(f"| {batch} | {temperature} | {v:.0f} | {s:.0f} | {v / s:.2f}× | {'' if same is None else same} |")
            rows.append(
                {
                    "batch": batch,
                    "temperature": temperature,
                    "k": args.num_speculative_tokens,
                    "vocab": args.vocab,
                    "ragged": args.ragged,
                    "vllm_us": v,
                    "specjax_us": s,
                    "same_greedy_tokens": same,
                    "impl": impl,
                }
            )
    print(f"# {os.getloadavg()[0]:.2f} (load average after)")
    if args.jsonl:
        append_jsonl(args.jsonl, rows)


if __name__ == "__main__":
    main()
