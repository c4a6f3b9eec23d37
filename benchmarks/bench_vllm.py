"""vLLM n-gram speculative decoding on CPU: vLLM's own rejection step vs specjax's (the vLLM plugin).

Runs in the vLLM environment (``make install-vllm``), with the engine in this
process so that the two steps can alternate call by call on one engine::

    LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python benchmarks/bench_vllm.py

For each batch size and temperature (0 = greedy, 0.7), the same requests run
``--rounds`` times with each step, alternating (vLLM, specjax, vLLM, ...):
output tokens per second end to end, and the acceptance step alone, timed
around vLLM's call of ``rejection_sample`` (the step that is replaced). The
model is a random Llama written to a temporary directory (vocabulary
``--vocab``, SmolLM2's by default) whose output head favours 512 tokens, as
text favours a few; prompts repeat a random sequence of them, so the n-gram
proposer finds drafts. Both runs use the plugin's repairs of vLLM's
processing (docs/vllm.md). The load average is printed with the results: on a
shared machine, compare ratios from one run, not absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_PLUGINS", "specjax")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


FAVOURED = 512


def write_model(path: Path, vocab: int, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=1024,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=vocab + 10,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # favour FAVOURED tokens, as text favours a few: n-gram lookups then find drafts
        model.lm_head.weight[:FAVOURED] *= 8
    model.save_pretrained(path)


class StepTimer:
    """Wraps vLLM's module-level ``rejection_sample`` (whichever is installed) and times each call."""

    def __init__(self, module) -> None:
        self.module = module
        self.inner = None
        self.times: list[float] = []

    def install(self) -> None:
        self.inner = self.module.rejection_sample
        self.module.rejection_sample = self

    def uninstall(self) -> None:
        self.module.rejection_sample = self.inner

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.times.append((time.perf_counter() - t0, int(args[0].shape[0])))  # (seconds, draft tokens T)
        return out


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--max-tokens", type=int, default=64)
    # rounds of one configuration spread by about ±10% here (B = 8, greedy): 9 give a steadier median ratio
    parser.add_argument("--rounds", type=int, default=9, help="timed runs per step and configuration")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--jsonl", metavar="PATH", help="append one JSON row per configuration to PATH")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy as np
    from results_io import append_jsonl  # imported now: it records the load at the start
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample import rejection_sampler

    import specjax.plugin.vllm as plugin

    model_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    write_model(model_dir, args.vocab, args.layers, args.hidden)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        enable_chunked_prefill=False,
        seed=0,
        speculative_config=spec,
    )
    if not plugin.is_registered():
        raise SystemExit("the specjax plugin is not registered: run with VLLM_PLUGINS=specjax (or unset)")
    rng = np.random.default_rng(0)

    def requests(batch: int) -> list:
        return [TokensPrompt(prompt_token_ids=(rng.integers(1, FAVOURED, 24).tolist() * 3)) for _ in range(batch)]

    def params(temperature: float, batch: int) -> list:
        return [
            SamplingParams(
                max_tokens=args.max_tokens, temperature=temperature, seed=i if temperature else None, ignore_eos=True
            )
            for i in range(batch)
        ]

    timer = StepTimer(rejection_sampler)
    timer.install()  # outermost: times whichever step is installed under it

    def use(kind: str) -> None:
        timer.uninstall()
        if kind == "specjax":
            plugin.register()
        else:
            plugin.unregister()
        timer.install()

    def run(kind: str, prompts: list, sp: list) -> tuple[float, list[tuple[float, int]]]:
        use(kind)
        timer.times.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / elapsed, list(timer.times)

    print(
        f"# bench_vllm: vocab {args.vocab}, {args.layers} layers, hidden {args.hidden}, n-gram k = "
        f"{args.num_speculative_tokens}, {args.max_tokens} new tokens per request, {args.rounds} rounds"
    )
    print(f"# load before: {load_average()}")
    rows = []
    for temperature in args.temperatures:
        for batch in args.batch_sizes:
            prompts = requests(batch)
            sp = params(temperature, batch)
            for kind in ("vllm", "specjax"):  # warm-up: compiles, caches
                run(kind, prompts, sp)
            tps = {"vllm": [], "specjax": []}
            steps = {"vllm": [], "specjax": []}
            for r in range(args.rounds):
                # alternate which goes first, so that neither always runs right after the other
                for kind in ("vllm", "specjax") if r % 2 == 0 else ("specjax", "vllm"):
                    rate, times = run(kind, prompts, sp)
                    tps[kind].append(rate)
                    steps[kind].extend(times)
            row = {
                "B": batch,
                "T": temperature,
                "ratio": statistics.median(s / v for s, v in zip(tps["specjax"], tps["vllm"], strict=True)),
                **{f"{k}_tps": statistics.median(v) for k, v in tps.items()},
                # the step with drafts (T > 0 rows of logits); steps without any draft only splice bonus tokens
                **{
                    f"{k}_step_us": 1e6 * statistics.median([t for t, n in v if n > 0] or [0.0])
                    for k, v in steps.items()
                },
                **{
                    f"{k}_step_share": sum(t for t, _ in v)
                    / (args.rounds * batch * args.max_tokens / statistics.mean(tps[k]))
                    for k, v in steps.items()
                },
            }
            rows.append(row)
            print(
                f"B={batch} T={temperature}: tok/s per round vLLM {[round(x, 1) for x in tps['vllm']]}, specjax "
                f"{[round(x, 1) for x in tps['specjax']]}; step with drafts (median) {row['vllm_step_us']:.0f} vs "
                f"{row['specjax_step_us']:.0f} µs; steps with drafts per run "
                f"{sum(n > 0 for _, n in steps['specjax']) // args.rounds}",
                flush=True,
            )
    timer.uninstall()
    plugin.register()
    print(f"# load after: {load_average()}")
    print()
    print(
        "| B | T | vLLM's step: tok/s | specjax: tok/s | ratio | vLLM's step: µs | specjax's step: µs | step ratio "
        "| share of wall time in the step: vLLM / specjax |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['B']} | {r['T']:g} | {r['vllm_tps']:.1f} | {r['specjax_tps']:.1f} | "
            f"{r['ratio']:.3f}× | {r['vllm_step_us']:.0f} | {r['specjax_step_us']:.0f} | "
            f"{r['vllm_step_us'] / max(r['specjax_step_us'], 1e-9):.2f}× | "
            f"{100 * r['vllm_step_share']:.1f}% / {100 * r['specjax_step_share']:.1f}% |"
        )
    print()
    print(
        "ratio: specjax's tokens/s over vLLM's (≥ 1 = specjax faster), median of the rounds' ratios. Step: median of "
        "vLLM's call of rejection_sample in steps with draft tokens; step ratio > 1 = specjax's faster."
    )
    if args.jsonl:
        append_jsonl(args.jsonl, [{**r, "rounds": args.rounds, "vocab": args.vocab} for r in rows])


if __name__ == "__main__":
    main()
