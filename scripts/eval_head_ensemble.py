"""Teacher-forced first-position agreement of two EAGLE heads, alone and averaged.

Both heads read the same target features over the held-out greedy generations
that ``scripts/train_eagle.py --evaluate`` uses (40 prompts, the target's own
greedy answers). At each generated position each head's draft distribution is
its softmax over its N tokens (0 elsewhere); the ensemble takes the argmax of
``a·p1 + (1 − a)·p2``. Printed: each head's agreement with the target's greedy
token, the ensemble's at a few weights, the share both heads get right and
the share at least one does (what a perfect chooser between them would reach).

    python scripts/eval_head_ensemble.py src/specjax/assets/smollm2-eagle DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", type=Path, nargs=2, help="two head directories (config.json + model.safetensors)")
    ap.add_argument("--weights", type=float, nargs="+", default=[0.3, 0.5, 0.7], help="a, the first head's weight")
    args = ap.parse_args(argv)
    if any(not 0 <= a <= 1 for a in args.weights):
        ap.error("--weights: expected values in [0, 1]")
    import torch
    import train_eagle as te

    from specjax.drafters.eagle_head import load_head
    from specjax.pair import load_target

    try:
        heads = [load_head(p).eval() for p in args.heads]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    target, tok = load_target()
    target.requires_grad_(False)
    _, held = te.heldout_greedy(target, tok, te.parse_args([]))
    data = te.with_features(target, held)
    embed, w = target.get_input_embeddings(), target.get_output_embeddings().weight.float()
    vocab = w.shape[0]
    alone, mixed = [0, 0], dict.fromkeys(args.weights, 0)
    both = either = total = 0
    with torch.inference_mode():
        for i in range(len(data)):
            ids, z, valid = te.collate(data, [i])
            z = z.float()
            pair_valid = valid[:, :-1] & valid[:, 1:]
            scored = pair_valid & (torch.arange(ids.shape[1] - 1)[None, :] >= data[i]["prompt_len"] - 1)
            emb = embed(ids[:, 1:]).float()
            theirs = (z[:, 1:] @ w.T).argmax(-1)
            probs = []
            for h in heads:
                scores = h(z[:, :-1], emb, pair_valid) @ w[h.token_ids].T
                full = torch.zeros((*scores.shape[:-1], vocab))
                full[..., h.token_ids] = scores.softmax(-1)
                probs.append(full)
            right = [(p.argmax(-1) == theirs) & scored for p in probs]
            for k in range(2):
                alone[k] += int(right[k].sum())
            for a in mixed:
                mixed[a] += int((((a * probs[0] + (1 - a) * probs[1]).argmax(-1) == theirs) & scored).sum())
            both += int((right[0] & right[1]).sum())
            either += int((right[0] | right[1]).sum())
            total += int(scored.sum())
    print(f"{total} generated positions of {len(data)} held-out answers")
    for k in range(2):
        print(f"head {args.heads[k]}: {alone[k] / total:.3f}")
    for a, hits in mixed.items():
        print(f"ensemble, weight {a:g} on the first: {hits / total:.3f}")
    print(f"both right: {both / total:.3f}; at least one right: {either / total:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
