"""``python -m recipes.eagle evaluate DIR``: a saved head drafting for the target on the CPU, end to end.

The figures a head directory's ``training_report.json`` gets beside its
training's (a head trained on an accelerator is measured here, on the
machine class it ships for): teacher-forced agreement with the target's greedy
token on the held-out prompts' greedy answers (over the head's own tokens, and
with the context's as the ``eagle`` drafter scores), acceptance per draft
position and speed-up when :class:`specjax.drafters.eagle.EagleDrafter`
drafts for the target on ``--eval-prompts`` held-out prompts (greedy, G = 4,
fixed schedule, its output checked token for token against the target's
``generate``), and the head's time per draft token at batch 1.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from recipes import draft
from recipes.eagle import torch_backend
from recipes.eagle.core import EOS_ID, log


def drafted_acceptance(head: Any, target: Any, tok: Any, prompts: list[str], g: int = 4) -> dict[str, Any]:
    """Acceptance per draft position when the head drafts for the target (greedy, fixed G), and the speed."""
    import specjax
    from specjax.drafters.eagle import EagleDrafter

    tested = [0.0] * g
    passed = [0.0] * g
    t_spec = t_target = 0.0
    new = 0
    for p in prompts:
        ids = torch.tensor([draft.chat_ids(tok, p)])
        t = time.perf_counter()
        ref = target.generate(ids, do_sample=False, max_new_tokens=64, pad_token_id=EOS_ID)
        t_target += time.perf_counter() - t
        t = time.perf_counter()
        out = specjax.speculative_generate(
            target, EagleDrafter(head), ids, max_new_tokens=64, num_draft_tokens=g, adaptive=False
        )
        t_spec += time.perf_counter() - t
        n = int(out.num_new_tokens[0])
        new += n
        if out.sequences[0, : ids.shape[1] + n].tolist() != ref[0, : ids.shape[1] + n].tolist():
            raise SystemExit(f"the speculative output differs from the target's greedy one on {p!r}")
        for i, (rate, n_tests) in enumerate(
            zip(out.stats.acceptance_rate_per_position, out.stats.tests_per_position, strict=True)
        ):
            tested[i] += n_tests
            passed[i] += rate * n_tests
    return {
        "acceptance_per_position": [p / t if t else 0.0 for p, t in zip(passed, tested, strict=True)],
        "speedup_fixed_g": t_target / t_spec if t_spec else None,
        "new_tokens": new,
        "same_as_target": True,
    }


def time_per_draft_token(head: Any, target: Any, reps: int = 50) -> float:
    """Seconds per drafted token at batch 1: the head's layer and its N-token scores."""
    from specjax.drafters.eagle_head import FeatureCache

    d = head.config.hidden_size
    cache = FeatureCache(1, head.config, "cpu", torch.float32)
    w = target.get_output_embeddings().weight[head.token_ids]
    f, e = torch.randn(1, 64, d), torch.randn(1, 64, d)
    with torch.inference_mode():
        head(f, e, torch.ones(1, 64, dtype=torch.bool), cache)
        x = torch.randn(1, 1, d)
        t = time.perf_counter()
        for _ in range(reps):
            y = head(x, e[:, :1], torch.ones(1, 1, dtype=torch.bool), cache)
            (y[:, 0] @ w.T).argmax(-1)
            cache.truncate(64)
        return (time.perf_counter() - t) / reps


def evaluate(args: argparse.Namespace) -> int:
    """The module docstring's figures for the head in ``args.dir``, merged into its ``training_report.json``."""
    from specjax.drafters.eagle_head import load_head
    from specjax.pair import load_target

    torch.set_num_threads(args.threads)
    log("loading the target")
    target, tok = load_target()
    target.requires_grad_(False)
    head = load_head(args.dir).eval()
    held_prompts, held = torch_backend.heldout_data(target, tok, args, head.target_hidden_layers)
    own, _ = torch_backend.agreement(head, target, held)
    context, _ = torch_backend.agreement(head, target, held, context=True)
    log(f"teacher-forced first-position agreement on the held-out answers: {own:.3f}, {context:.3f} with the context")
    drafted = drafted_acceptance(head, target, tok, held_prompts[: args.eval_prompts])
    log(f"drafting on {args.eval_prompts} held-out prompts: {drafted}")
    t_draft = time_per_draft_token(head, target)
    log(f"time per draft token {t_draft * 1e3:.2f} ms")
    report_file = args.dir / "training_report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    report.update(
        drafted,
        heldout_agreement_first_position_cpu=own,
        heldout_agreement_first_position_cpu_context=context,
        time_per_draft_token_s=t_draft,
        evaluated_on_prompts=args.eval_prompts,
    )
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    log(f"updated {report_file}")
    return 0
