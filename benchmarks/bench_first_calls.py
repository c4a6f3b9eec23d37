"""The first calls of a fresh process: does the adaptive draft length draft from the start?

A user who loads the default pair and calls ``speculative_generate`` a few
times pays whatever the schedule learns on its first calls (the target's cost
at each verification width is timed once per model and batch size,
``specjax.generate.schedule``). The steady-state benchmarks hide that behind
warm-up calls; this one has none besides a single one-token call per method
(torch's and JAX's one-time compilation, not the schedule's learning). In one
fresh process it runs the open-chat prompts in turn (``--calls`` calls),
greedy at B = 1 with the ``eagle`` drafter, each call right after a
target-only ``generate`` of the same prompt, and prints per call: the time of
each, the speed-up, the share of steps that drafted, and whether the output is
the target's. Prints the load average before and after.

    python benchmarks/bench_first_calls.py --calls 6 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from pair_calls import eos_and_pad, greedy_target_only
from results_io import _cpu_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=6, help="calls per method, prompts in turn")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, default=8, help="G, the most tokens a step drafts")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if min(args.calls, args.max_new_tokens, args.num_draft_tokens, args.threads) < 1:
        ap.error("--calls, --max-new-tokens, --num-draft-tokens and --threads: expected positive integers")
    torch.set_num_threads(args.threads)

    from specjax.demo import _encode
    from specjax.generate import speculative_generate
    from specjax.pair import load_default_pair, make_pair_drafter
    from specjax.prompts import OPEN_CHAT

    print(f"load average before: {os.getloadavg()}; {_cpu_model()}; torch threads {args.threads}", flush=True)
    pair = load_default_pair()
    eos, pad = eos_and_pad(pair)
    names = list(OPEN_CHAT)
    encoded = {n: _encode(pair.tokenizer, OPEN_CHAT[n]) for n in names}

    def spec(ids: torch.Tensor, mask: torch.Tensor, new: int) -> tuple[list[int], float]:
        out = speculative_generate(
            pair.target,
            make_pair_drafter("eagle", head=pair.head),
            ids,
            mask,
            max_new_tokens=new,
            num_draft_tokens=args.num_draft_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        share = out.stats.draft_steps / max(out.stats.steps, 1)
        return out.sequences[0, ids.shape[1] :].tolist(), share

    # one-time compilation and loading only: one token each, on the first prompt
    greedy_target_only(pair, 1)(*encoded[names[0]])
    spec(*encoded[names[0]], 1)
    target_only = greedy_target_only(pair, args.max_new_tokens)
    print("| call | prompt | target-only s | specjax s | speed-up | steps drafting | same output |")
    print("|---:|---|---:|---:|---:|---:|---|")
    ups = []
    for i in range(args.calls):
        name = names[i % len(names)]
        ids, mask = encoded[name]
        t = time.perf_counter()
        ref = target_only(ids, mask)
        t_ref = time.perf_counter() - t
        t = time.perf_counter()
        got, share = spec(ids, mask, args.max_new_tokens)
        t_spec = time.perf_counter() - t
        ups.append(t_ref / t_spec)
        print(f"| {i + 1} | {name} | {t_ref:.2f} | {t_spec:.2f} | {t_ref / t_spec:.2f}x | {share:.2f} | {got == ref} |")
    print(f"median speed-up {statistics.median(ups):.2f}x, mean {statistics.mean(ups):.2f}x")
    print(f"load average after: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
