"""``specjax demo --device jax``'s code on JAX's CPU backend, with a tiny pair (no assets needed).

The demo's own loop (:func:`specjax.demo.run_pair_demo`) over a random Llama
target and a perturbed copy as its draft, both on torchax's jax device, with a
character-level tokenizer: it must print which device ran, stream both modes
for the two ``--quick`` prompts, and find every greedy output identical to the
target alone on the same device (``jax_loop.greedy_decode``). The installed
command with the real pair is tested in test_demo.py (``demo_pair``).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

# torchax registers torch's "jax" device in this process, which breaks accelerate's
# offloading elsewhere: these run in their own pytest session (make test-torchax).
pytestmark = pytest.mark.torchax

pytest.importorskip("torchax")


@pytest.fixture(scope="module")
def tiny_pair(tiny_lm, perturbed_copy, char_tokenizer):
    from specjax.generate.jax_model import to_jax_device
    from specjax.pair.loading import DefaultPair

    target = tiny_lm("llama", vocab_size=96, layers=2, hidden=32, seed=0, max_position_embeddings=1024)
    draft = perturbed_copy(target, noise=0.05, seed=1)
    return DefaultPair(
        target=to_jax_device(target),
        draft=to_jax_device(draft),
        tokenizer=char_tokenizer,
        target_load_s=0.0,
        draft_load_s=0.0,
        target_path=Path("tiny-target"),
        draft_path=Path("tiny-draft"),
        num_draft_tokens=3,
    )


def test_quick_demo_on_jax_runs_the_pair_against_the_target_alone(tiny_pair):
    from specjax.demo import run_pair_demo

    buf = io.StringIO()
    assert run_pair_demo(tiny_pair, quick=True, max_new_tokens=12, out=buf) == 0
    out = buf.getvalue()
    assert re.search(r"device: JAX's default device \S+ \(.*, backend cpu\) through torchax", out), out
    assert "target-only reference: specjax.generate.jax_loop.greedy_decode" in out
    rows = [line for line in out.splitlines() if re.search(r"\s(greedy|T=0\.7)\s", line)]
    assert len(rows) == 4, out  # --quick: one open-chat and one grounded prompt, greedy and sampled
    for row in rows:
        assert " hybrid-model " in row and re.search(r"\d+\.\d\dx", row), row
    greedy = [r for r in rows if " greedy " in r]
    assert len(greedy) == 2 and all(r.rstrip().endswith("yes") for r in greedy), out
    assert "speed-up" in out and "JIT compilation" in out
