"""Drafters and ``speculative_generate``'s arguments under use a server makes (issue 58), on tiny models.

Each test failed before its fix:

* one drafter object shared by concurrent calls (threads): the calls overwrote each other's
  state (``zip()`` errors, shape errors); now a call given a drafter another call is using
  runs on its ``fork()``, and a third-party drafter without one is refused by name;
* a sampled draft model (or EAGLE head) whose logits are NaN: an ``IndexError`` inside
  torch, now a ``ValueError`` naming the draft model (or head);
* ``num_draft_tokens = 10**7`` was accepted (statistics of 10 million entries); now capped,
  and cut to what ``max_new_tokens`` lets a row draft;
* ``eos_token_id`` as a NumPy array or 0-d array was refused;
* ``stats.wall_time_s`` left out the call's checks and setup.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import specjax
from specjax.drafters import EagleDrafter, HybridDrafter, ModelDrafter, NgramDrafter, Proposal
from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights

V = 96  # shared with the other integration tests: the loop's compilations are shared


@pytest.fixture(scope="module")
def pair(tiny_lm, perturbed_copy):
    target = tiny_lm("llama", vocab_size=V, layers=2, seed=0)
    return target, perturbed_copy(target, noise=0.3, seed=1)


def untrained_head(target) -> EagleHead:
    """An EAGLE head for ``target`` (its near-identity start: it drafts, often wrongly)."""
    head = EagleHead(EagleConfig(target.config.hidden_size, 4, 2, 64, V, V))
    init_weights(head, 0)
    return head.eval()


def greedy_reference(target, ids, mask, max_new_tokens):
    return target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)


def repeating(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts that repeat a phrase (n-gram lookups match) of one length, no padding."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        phrase = rng.integers(1, V, size=5).tolist()
        rows.append((phrase * (length // 5 + 1))[:length])
    ids = torch.tensor(rows)
    return ids, torch.ones_like(ids)


# --------------------------------------------------------------------------- one drafter, concurrent calls


def run_overlapping(calls, timeout=120.0):
    """Run ``calls`` (functions of ``on_tokens``) in threads, all inside their loops at once.

    Each call's first ``on_tokens`` waits until every call has reached its own: from then on
    all calls have started (their drafters hold their state) and none has finished. Returns
    each call's result or exception.
    """
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def work(i):
        first = [True]

        def on_tokens(row, tokens):
            if first[0]:
                first[0] = False
                barrier.wait(timeout=timeout)

        try:
            results[i] = calls[i](on_tokens)
        except BaseException as err:  # reported to the test, which judges it
            barrier.abort()
            results[i] = err

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
        assert not t.is_alive(), "a call hung"
    return results


@pytest.mark.parametrize("kind", ["hybrid", "model", "ngram", "eagle"])
def test_one_drafter_shared_by_overlapping_calls_gives_each_its_greedy_output(pair, kind):
    target, draft = pair
    drafter = {
        "hybrid": lambda: HybridDrafter(NgramDrafter(), ModelDrafter(draft)),
        "model": lambda: ModelDrafter(draft),
        "ngram": lambda: NgramDrafter(),
        "eagle": lambda: EagleDrafter(untrained_head(target)),
    }[kind]()
    prompts = [repeating(1, 12, seed=1), repeating(3, 9, seed=2), repeating(2, 15, seed=3)]
    calls = [
        lambda on_tokens, ids=ids, mask=mask: specjax.speculative_generate(
            target, drafter, ids, mask, max_new_tokens=14, on_tokens=on_tokens
        )
        for ids, mask in prompts
    ]
    results = run_overlapping(calls)
    for (ids, mask), out in zip(prompts, results, strict=True):
        assert not isinstance(out, BaseException), [repr(r) for r in results]
        assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 14))
    # released: the drafter itself serves the next call
    out = specjax.speculative_generate(target, drafter, *prompts[0], max_new_tokens=6)
    assert torch.equal(out.sequences, greedy_reference(target, *prompts[0], 6))


def test_shared_drafters_in_a_thread_pool_give_what_each_call_gives_alone(pair):
    """Four threads, three calls each, greedy and sampled, on two shared drafters (a server's pattern)."""
    target, draft = pair
    shared = {"hybrid": HybridDrafter(NgramDrafter(), ModelDrafter(draft)), "model": ModelDrafter(draft)}
    jobs = []
    for t in range(4):
        for c in range(3):
            ids, mask = repeating(1 + (t + c) % 3, 8 + 2 * t + c, seed=10 * t + c)
            jobs.append((t, "hybrid" if (t + c) % 2 else "model", ids, mask, 0.0 if c != 1 else 1.0, t * 3 + c))

    def run(job, drafter):
        _, _, ids, mask, temperature, seed = job
        return specjax.speculative_generate(
            target, drafter, ids, mask, max_new_tokens=10, temperature=temperature, seed=seed, adaptive=False
        ).sequences

    # alone, each on a drafter of its own (sampled with adaptive=False: reproducible from the seed)
    alone = [
        run(job, HybridDrafter(NgramDrafter(), ModelDrafter(draft)) if job[1] == "hybrid" else draft) for job in jobs
    ]
    got: dict[int, object] = {}

    def worker(t):
        for i, job in enumerate(jobs):
            if job[0] == t:
                try:
                    got[i] = run(job, shared[job[1]])
                except BaseException as err:  # judged below
                    got[i] = err

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
        assert not th.is_alive(), "a call hung"
    for i, want in enumerate(alone):
        assert not isinstance(got[i], BaseException), repr(got[i])
        assert torch.equal(got[i], want), i


class _NoFork:
    """A third-party drafter without fork(): deterministic proposals of each row's last token."""

    name = "no_fork"
    needs_target_hidden = False
    cost_per_token_hint = 0.0

    def __init__(self):
        self.rows = 0

    def start(self, setup):
        self.rows = len(setup.contexts)

    def propose(self, request):
        k = np.asarray(request.max_tokens, np.int64)
        assert len(k) <= self.rows  # its state is the call's
        last = np.array([c[-1] for c in request.contexts], np.int64)
        return Proposal(np.repeat(last[:, None], int(k.max(initial=0)), axis=1), k, None)

    def commit(self, info):
        pass

    def select_rows(self, rows):
        self.rows = len(rows)


def test_a_drafter_without_fork_in_use_by_another_call_is_refused_by_name(pair):
    target, _ = pair
    drafter = _NoFork()
    ids, mask = repeating(2, 10, seed=4)
    holding = threading.Event()
    release = threading.Event()
    first: list = []

    def hold(row, tokens):
        holding.set()
        assert release.wait(timeout=60)

    def long_call():
        try:
            first.append(specjax.speculative_generate(target, drafter, ids, mask, max_new_tokens=4, on_tokens=hold))
        except BaseException as err:  # judged below
            first.append(err)
            holding.set()

    thread = threading.Thread(target=long_call)
    thread.start()
    try:
        assert holding.wait(timeout=60)
        with pytest.raises(
            ValueError,
            match=r"draft: drafter 'no_fork' \(_NoFork\) is in use by another speculative_generate call.*"
            r"pass one drafter object per concurrent call .*or give its class a fork\(\) method",
        ):
            specjax.speculative_generate(target, drafter, ids[:1], mask[:1], max_new_tokens=4)
    finally:
        release.set()
        thread.join(timeout=60)
    assert not isinstance(first[0], BaseException), repr(first[0])
    assert torch.equal(first[0].sequences, greedy_reference(target, ids, mask, 4))
    # the finished call released it
    out = specjax.speculative_generate(target, drafter, ids[:1], mask[:1], max_new_tokens=4)
    assert torch.equal(out.sequences, greedy_reference(target, ids[:1], mask[:1], 4))


def test_a_hybrid_whose_fallback_cannot_fork_is_refused_while_in_use(pair):
    target, _ = pair
    drafter = HybridDrafter(NgramDrafter(), _NoFork())
    ids, mask = repeating(1, 10, seed=5)
    inner: list = []

    def nested(row, tokens):  # a second call on the same drafter while the first runs (same thread)
        if not inner:
            try:
                specjax.speculative_generate(target, drafter, ids, mask, max_new_tokens=2)
                inner.append(None)
            except ValueError as err:
                inner.append(err)

    out = specjax.speculative_generate(target, drafter, ids, mask, max_new_tokens=4, on_tokens=nested)
    assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 4))
    assert inner[0] is not None and "its drafter 'no_fork' has no fork()" in str(inner[0])


def test_an_error_inside_a_call_releases_the_drafter(pair):
    target, draft = pair
    drafter = ModelDrafter(draft)
    ids, mask = repeating(1, 8, seed=6)

    def fail(row, tokens):
        raise KeyError("from on_tokens")

    with pytest.raises(KeyError):
        specjax.speculative_generate(target, drafter, ids, mask, max_new_tokens=4, on_tokens=fail)
    out = specjax.speculative_generate(target, drafter, ids, mask, max_new_tokens=4, return_state=True)
    assert out.state is not None and out.state.draft_cache is drafter.cache  # the object itself, not a fork


# --------------------------------------------------------------------------- a draft model with NaN logits


@pytest.fixture(scope="module")
def nan_draft(pair):
    import copy

    draft = copy.deepcopy(pair[1])
    with torch.no_grad():
        draft.lm_head.weight.fill_(float("nan"))
    return draft


@pytest.mark.parametrize("kind", ["model", "hybrid"])
def test_a_sampled_draft_model_with_nan_logits_is_named(pair, nan_draft, kind):
    target, _ = pair
    drafter = nan_draft if kind == "model" else HybridDrafter(NgramDrafter(), ModelDrafter(nan_draft))
    ids = torch.tensor([[5, 17, 42, 8, 23]])  # no repeat: the fallback drafts
    with pytest.raises(
        ValueError,
        match=r"draft: the draft model LlamaForCausalLM \(drafter 'model:LlamaForCausalLM'\) gave logits that "
        r"are not a distribution \(a NaN or \+inf logit, or all -inf\) in row 0 at draft position 1",
    ):
        specjax.speculative_generate(target, drafter, ids, max_new_tokens=6, temperature=1.0, adaptive=False)


def test_a_sampled_eagle_head_with_nan_weights_is_named(pair):
    target, _ = pair
    head = untrained_head(target)
    with torch.no_grad():
        head.fc.weight.fill_(float("nan"))
    ids = torch.tensor([[5, 17, 42, 8, 23]])
    with pytest.raises(
        ValueError,
        match=r"draft: the eagle head \(drafter 'eagle'\) gave logits that are not a distribution .* "
        r"at draft position 1",
    ):
        specjax.speculative_generate(target, EagleDrafter(head), ids, max_new_tokens=6, temperature=1.0, adaptive=False)


def test_a_greedy_draft_model_with_nan_logits_still_gives_the_target_output(pair, nan_draft):
    target, _ = pair
    ids = torch.tensor([[5, 17, 42, 8, 23]])
    out = specjax.speculative_generate(target, nan_draft, ids, max_new_tokens=6, adaptive=False)
    assert torch.equal(out.sequences, greedy_reference(target, ids, torch.ones_like(ids), 6))


# --------------------------------------------------------------------------- num_draft_tokens


@pytest.mark.parametrize("g", [10**7, 129, 2**70])
def test_num_draft_tokens_beyond_the_cap_is_refused(pair, g):
    target, draft = pair
    with pytest.raises(ValueError, match=r"num_draft_tokens: expected an integer in \[1, 128\]"):
        specjax.speculative_generate(target, draft, torch.tensor([[5, 17, 42]]), max_new_tokens=4, num_draft_tokens=g)


@pytest.mark.parametrize(("g", "max_new_tokens", "positions"), [(128, 4, 3), (6, 1, 1), (3, 9, 3)])
def test_num_draft_tokens_is_cut_to_what_a_row_can_draft(pair, g, max_new_tokens, positions):
    target, _ = pair
    ids = torch.tensor([[5, 17, 42, 8, 5, 17, 42, 8]])
    out = specjax.speculative_generate(
        target, target, ids, max_new_tokens=max_new_tokens, num_draft_tokens=g, adaptive=False
    )
    assert torch.equal(out.sequences, greedy_reference(target, ids, torch.ones_like(ids), max_new_tokens))
    assert len(out.stats.acceptance_rate_per_position) == len(out.stats.tests_per_position) == positions


# --------------------------------------------------------------------------- eos_token_id and wall time


@pytest.fixture(scope="module")
def eos_case(pair):
    """A prompt, and an EOS id its greedy continuation first meets at token ``n`` (> 1)."""
    target, _ = pair
    ids = torch.tensor([[5, 17, 42, 8, 23]])
    free = specjax.speculative_generate(target, "ngram", ids, max_new_tokens=12).sequences[0, 5:].tolist()
    n = next(i + 1 for i in range(1, len(free)) if free[i] not in free[:i])
    return ids, free[n - 1], n


@pytest.mark.parametrize(
    "form",
    [
        lambda e: np.array([e, e]),
        lambda e: np.array([e], np.int32),
        lambda e: np.array(e),
        lambda e: np.int64(e),
        lambda e: [np.int32(e)],
        lambda e: torch.tensor(e),
    ],
    ids=["array", "int32-array", "0-d", "np-scalar", "list-of-np", "0-d-tensor"],
)
def test_eos_token_id_as_numpy_is_taken(pair, eos_case, form):
    target, draft = pair
    ids, eos, n = eos_case
    want = specjax.speculative_generate(target, draft, ids, max_new_tokens=12, eos_token_id=[eos])
    got = specjax.speculative_generate(target, draft, ids, max_new_tokens=12, eos_token_id=form(eos))
    assert got.num_new_tokens.tolist() == want.num_new_tokens.tolist() == [n]
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.parametrize(
    "value", [np.array([1.0]), np.array(True), np.array([-1]), np.array([[1, 2]], np.float32), np.array(2.0)]
)
def test_eos_token_id_numpy_of_floats_bools_or_negatives_is_refused(pair, value):
    target, draft = pair
    with pytest.raises(ValueError, match=r"eos_token_id: expected token ids \(integers >= 0\)"):
        specjax.speculative_generate(target, draft, torch.tensor([[5, 17]]), max_new_tokens=2, eos_token_id=value)


class _SlowVocab:
    """A tokenizer whose vocabulary takes a while to read (the call checks the pair's tokenizers in its setup)."""

    def __init__(self, seen: list[float]):
        self.seen = seen

    def get_vocab(self):
        self.seen.append(time.perf_counter())
        time.sleep(0.2)
        return {f"t{i}": i for i in range(V)}


def test_wall_time_covers_the_calls_setup(pair):
    target, draft = pair
    seen: list[float] = []
    forwards: list[float] = []
    handle = target.register_forward_hook(lambda *_: forwards.append(time.perf_counter()))
    try:
        out = specjax.speculative_generate(
            target,
            draft,
            torch.tensor([[5, 17, 42]]),
            max_new_tokens=3,
            target_tokenizer=_SlowVocab(seen),
            draft_tokenizer=_SlowVocab(seen),
        )
    finally:
        handle.remove()
    # the call started before its setup read the first vocabulary and ended after the last forward
    assert out.stats.wall_time_s >= forwards[-1] - seen[0]
    s = out.stats
    assert s.tokens_per_s == pytest.approx(s.new_tokens / (s.wall_time_s - s.compile_time_s))
