"""Would tree drafting (EAGLE-2 style) lift the default pair past 1.5x at batch 1, greedy?

An experiment, not a product path: a small B = 1 greedy loop over the default
pair (SmolLM2-135M-Instruct and the shipped EAGLE head) that drafts a *tree*
with the head, the ``k`` best first tokens each followed by a greedy chain, and
verifies every branch in one target forward under a tree attention mask (a
custom 4D mask; each node sees the cache, the root and its own ancestors). The
target's greedy token at each node picks the path; the KV cache then keeps the
root and the accepted nodes only. ``--shapes 4`` is the plain chain of 4 (the
same code), ``4,3`` a tree whose best first token carries a chain of 4 and the
second best a chain of 3 (1 + 4 + 3 = 8 tokens verified), and so on.

Each call is held against ``target.generate`` (greedy, the same tokens) and
timed side by side with it and with ``speculative_generate`` (the product's
``eagle`` drafter, its adaptive length), alternating method by method within
each prompt. Prints the load average, per method tokens/s, the speed-up over
target-only (median over the open-chat prompts) and the mean tokens per
verification.

    python benchmarks/bench_tree.py --shapes 4 4,3 4,2,1 --max-new-tokens 96 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from pair_calls import eos_and_pad, greedy_target_only

from specjax.slots import cache_argument


def parse_shape(text: str) -> tuple[int, ...]:
    """``"4,3"`` -> (4, 3): branch depths, best first token first; each ≥ 1, non-increasing."""
    try:
        depths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: expected comma-separated depths like 4,3, got {text!r}") from None
    if not depths or min(depths) < 1 or list(depths) != sorted(depths, reverse=True):
        raise argparse.ArgumentTypeError(f"--shapes: expected positive, non-increasing depths, got {text!r}")
    return depths


class TreeRunner:
    """Greedy B = 1 generation with a tree of head drafts (see the module docstring)."""

    def __init__(self, target: Any, head: Any) -> None:
        self.target = target
        self.head = head.eval()
        self.embed = target.get_input_embeddings()
        self.head_weight = target.get_output_embeddings().weight[head.token_ids]  # f[N, d]
        self.cache_kw = cache_argument(target)

    def _draft(self, cache: Any, feature: torch.Tensor, depths: tuple[int, ...]) -> list[list[int]]:
        """Branch j: the j-th best first token, then the head's greedy chain, ``depths[j]`` tokens in all."""
        from specjax.drafters.eagle_head import FeatureCache

        k, dmax = len(depths), depths[0]
        ids = self.head.token_ids
        first = (feature @ self.head_weight.T).topk(k, dim=-1).indices[0]  # i64[k]
        x = ids[first]  # i64[k]
        rows = [x]
        if dmax > 1:
            tmp = FeatureCache(k, self.head.config, feature.device, feature.dtype)
            tmp.keys = [t.expand(k, -1, -1, -1) for t in cache.keys]  # per decoder layer
            tmp.values = [t.expand(k, -1, -1, -1) for t in cache.values]
            tmp.valid, tmp.num_valid = cache.valid.expand(k, -1), cache.num_valid.expand(k)
            f = feature.expand(k, -1)
            ones = torch.ones((k, 1), dtype=torch.bool)
            for _ in range(dmax - 1):
                f = self.head(f[:, None], self.embed(x)[:, None], ones, tmp)[:, 0]
                x = ids[(f @ self.head_weight.T).max(dim=-1).indices]
                rows.append(x)
        table = torch.stack(rows, dim=1).tolist()  # [k][dmax]
        return [table[j][: depths[j]] for j in range(k)]

    @torch.inference_mode()
    def generate(self, ids: torch.Tensor, max_new: int, eos: int, depths: tuple[int, ...]) -> tuple[list[int], int]:
        """Greedy continuation of ``ids`` (i64[1, P]): (new token ids, number of target forwards)."""
        from transformers import DynamicCache

        from specjax.drafters.eagle_head import FeatureCache

        target, head, kw = self.target, self.head, self.cache_kw
        p = ids.shape[1]
        cache = DynamicCache(config=target.config)
        out = target(input_ids=ids[:, :-1], **{kw: cache}, use_cache=True, output_hidden_states=True)
        hcache = FeatureCache(1, head.config, ids.device, torch.float32)
        z = out.hidden_states[-1]  # f[1, P-1, d]: z_t, t < P-1
        f_all = head(z, self.embed(ids[:, 1:]), torch.ones((1, p - 1), dtype=torch.bool), hcache)
        feature = f_all[:, -1]  # predicts z_{P-1}
        root = int(ids[0, -1])
        new: list[int] = []
        forwards = 1
        n = p  # committed tokens; the cache holds n - 1
        while len(new) < max_new:
            branches = self._draft(hcache, feature, depths)
            tokens = [root] + [t for br in branches for t in br]
            w = len(tokens)
            parent = [-1]
            depth = [0]
            for br in branches:
                for i in range(len(br)):
                    parent.append(0 if i == 0 else len(parent) - 1)
                    depth.append(i + 1)
            tree = torch.zeros((w, w), dtype=torch.bool)
            for a in range(w):
                b = a
                while b >= 0:
                    tree[a, b] = True
                    b = parent[b]
            s = n - 1
            mask = torch.cat([torch.ones((w, s), dtype=torch.bool), tree], dim=1)[None, None]
            pos = torch.tensor([[s + d for d in depth]])
            out = target(
                input_ids=torch.tensor([tokens]),
                **{kw: cache},
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                output_hidden_states=True,
            )
            forwards += 1
            greedy = out.logits[0].argmax(dim=-1).tolist()
            path = [0]
            emitted = []
            while True:
                t = greedy[path[-1]]
                emitted.append(t)
                nxt = next((c for c in range(w) if parent[c] == path[-1] and tokens[c] == t), None)
                if nxt is None or t == eos:
                    break
                path.append(nxt)
            # the cache keeps the committed prefix, the root and the accepted nodes
            keep = torch.tensor(list(range(s)) + [s + c for c in path])
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(2, keep)
                layer.values = layer.values.index_select(2, keep)
            zs = out.hidden_states[-1][:, path]  # f[1, len(path), d]
            o = head(zs, self.embed(torch.tensor([emitted])), torch.ones((1, len(path)), dtype=torch.bool), hcache)
            feature = o[:, -1]
            new.extend(emitted)
            n += len(emitted)
            root = emitted[-1]
            if eos in emitted:
                break
        new = new[:max_new]
        if eos in new:
            new = new[: new.index(eos) + 1]
        return new, forwards - 1  # verifications (the prefill is not one)


def verify_cost(target: Any, w: int, context: int = 150, reps: int = 20) -> float:
    """Median seconds of one target forward over ``w`` new tokens after ``context`` cached ones, with
    ``output_hidden_states`` and a custom 4D mask, as :class:`TreeRunner` runs it."""
    from transformers import DynamicCache

    kw = cache_argument(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, context + w), generator=g)
    mask = torch.cat([torch.ones((w, context), dtype=torch.bool), torch.ones((w, w), dtype=torch.bool).tril()], 1)
    costs = []
    for _ in range(reps):
        cache = DynamicCache(config=target.config)
        with torch.inference_mode():
            target(input_ids=ids[:, :context], **{kw: cache}, use_cache=True)
            t0 = time.perf_counter()
            target(
                input_ids=ids[:, context:],
                **{kw: cache},
                attention_mask=mask[None, None],
                position_ids=torch.arange(context, context + w)[None],
                use_cache=True,
                output_hidden_states=True,
            )
            costs.append(time.perf_counter() - t0)
    return statistics.median(costs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[(4,), (4, 3), (4, 2, 1)])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per prompt and method")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.repeats < 1:
        ap.error("--max-new-tokens and --repeats: expected positive integers")
    torch.set_num_threads(args.threads)

    from specjax.demo import _encode
    from specjax.generate import speculative_generate
    from specjax.pair import load_default_pair, make_pair_drafter
    from specjax.prompts import OPEN_CHAT

    print(f"load average before: {os.getloadavg()}", flush=True)
    pair = load_default_pair()
    target, tok, head = pair.target, pair.tokenizer, pair.head
    eos, pad = eos_and_pad(pair)
    runner = TreeRunner(target, head)
    g = pair.num_draft_tokens

    target_only = greedy_target_only(pair, args.max_new_tokens)

    def product(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
        out = speculative_generate(
            target,
            make_pair_drafter("eagle", head=head),
            ids,
            mask,
            max_new_tokens=args.max_new_tokens,
            num_draft_tokens=g,
            temperature=0.0,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        return out.sequences[0, ids.shape[1] :].tolist()

    methods: dict[str, Any] = {"target-only": None, f"specjax eagle (adaptive, G={g})": None}
    for shape in args.shapes:
        methods["tree " + ",".join(map(str, shape))] = shape
    names = list(methods)
    # warm-up (compilation, the adaptive length's timings), untimed
    ids0, mask0 = _encode(tok, next(iter(OPEN_CHAT.values())))
    product(ids0, mask0)
    target_only(ids0, mask0)
    for shape in args.shapes:
        runner.generate(ids0, 8, eos, shape)

    # what one verification costs at each shape's width (median of 20, a 150-token cache, full logits)
    for shape in args.shapes:
        w = 1 + sum(shape)
        print(
            f"verification of {w} tokens (shape {','.join(map(str, shape))}): {1000 * verify_cost(target, w):.1f} ms",
            flush=True,
        )
    times: dict[str, dict[str, float]] = {m: {} for m in names}
    counts: dict[str, dict[str, int]] = {m: {} for m in names}
    steps: dict[str, int] = {m: 0 for m in names}
    same: dict[str, bool] = {m: True for m in names}
    for prompt, messages in OPEN_CHAT.items():
        ids, mask = _encode(tok, messages)
        ref = target_only(ids, mask)
        for r in range(args.repeats):
            order = names if r % 2 == 0 else names[::-1]
            for m in order:
                t0 = time.perf_counter()
                if m == "target-only":
                    got, fw = target_only(ids, mask), 0
                elif m.startswith("specjax"):
                    got, fw = product(ids, mask), 0
                else:
                    got, fw = runner.generate(ids, args.max_new_tokens, eos, methods[m])
                dt = time.perf_counter() - t0
                times[m][prompt] = times[m].get(prompt, 0.0) + dt
                counts[m][prompt] = counts[m].get(prompt, 0) + len(got)
                steps[m] += fw
                same[m] = same[m] and got == ref
        print(f"  {prompt}: {len(ref)} tokens", flush=True)
    print(f"load average after: {os.getloadavg()}")
    base = {p: counts["target-only"][p] / times["target-only"][p] for p in OPEN_CHAT}
    print(f"\n{'method':34s} {'tok/s':>7s} {'speed-up (median)':>18s} {'min':>6s} {'tokens/verify':>14s} same")
    for m in names:
        tps = {p: counts[m][p] / times[m][p] for p in OPEN_CHAT}
        ratios = [tps[p] / base[p] for p in OPEN_CHAT]
        total = sum(counts[m].values())
        per = f"{total / steps[m]:.2f}" if steps[m] and not m.startswith("target") else "-"
        print(
            f"{m:34s} {statistics.mean(tps.values()):7.1f} {statistics.median(ratios):17.2f}x "
            f"{min(ratios):5.2f}x {per:>14s} {same[m]}"
        )
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
