"""The device-resident loop with models on torchax's jax device (issue 55), on JAX's CPU backend: the same
results as the per-step path, one program a call, the draft schedule's plain and drafted steps, the step
program's form (no scatter), and the TPU's bfloat16 caches (forced here).

Split from tests/test_torchax_loop.py (same fixtures, :mod:`torchax_models`) so that the torchax session's
two workers share the loop's tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from torchax_models import LOOP_G as G
from torchax_models import LOOP_MAX_NEW as MAX_NEW
from torchax_models import loop_models, make_drafter, ragged_prompts, target_greedy, tiny_llama

from specjax.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from specjax.generate import jax_loop, jax_model, speculative_generate
from specjax.generate.compile_time import measure_compiles
from specjax.generate.jax_loop import greedy_decode, per_step_loop

# torchax registers torch's "jax" device in this process, which breaks accelerate's
# offloading elsewhere: these run in their own pytest session (make test-torchax).
pytestmark = pytest.mark.torchax


@pytest.fixture(scope="module")
def models():
    return loop_models()


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts()


_TIMINGS = {"wall_time_s", "compile_time_s", "tokens_per_s", "draft_time_s", "target_time_s", "loop_time_s"}
_SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.9, seed=11)
_SAMPLED_07 = dict(temperature=0.7, seed=5)


def _counting_programs(monkeypatch) -> list[int]:
    """A list that gets an entry each time the device-resident program is called."""
    programs: list[int] = []
    real = jax_loop.resident_steps
    monkeypatch.setattr(jax_loop, "resident_steps", lambda *a, **k: programs.append(1) or real(*a, **k))
    return programs


def _both_paths(jx, draft, ids, mask, monkeypatch, **kw):
    """``(device-resident, per-step)`` results of one call, each as (output, stats without timings, the
    ``on_tokens`` calls), and how many programs the device-resident one ran."""
    programs = _counting_programs(monkeypatch)

    def run():
        calls = []
        out = speculative_generate(
            jx["target"], make_drafter(draft, jx), ids, mask, on_tokens=lambda b, t: calls.append((b, list(t))), **kw
        )
        return out, {k: v for k, v in out.stats.as_dict().items() if k not in _TIMINGS}, calls

    resident = run()
    with per_step_loop():
        per_step = run()
    return resident, per_step, len(programs)


@pytest.mark.parametrize(
    "draft, sampling, max_new, eos_at",
    [
        ("close", {}, MAX_NEW, None),
        ("far", {}, MAX_NEW, None),  # acceptance near 0: over STREAM_STEPS steps, several chunks
        ("close", _SAMPLED, MAX_NEW, None),
        ("far", _SAMPLED, MAX_NEW, None),
        ("close", {}, MAX_NEW, 5),  # row 0 ends at EOS, the others at their own EOS or max_new
        ("close", _SAMPLED, MAX_NEW, 2),
        ("close", {}, 1, None),  # no draft token fits: k = 0 every step
        ("close", {}, 2, 0),
        ("close", _SAMPLED, 5, None),
        ("ngram", {}, MAX_NEW, None),
        ("ngram", _SAMPLED_07, MAX_NEW, None),
        ("ngram", {}, 13, 4),
        ("ngram", _SAMPLED_07, 7, 1),
        ("ngram", {}, 1, None),
        ("hybrid", {}, MAX_NEW, None),
        ("hybrid", _SAMPLED_07, MAX_NEW, None),
        ("hybrid", _SAMPLED, 13, None),
        ("hybrid", {}, 11, 3),
        ("hybrid", _SAMPLED_07, 7, 2),
    ],
    ids=[
        "greedy",
        "greedy-chunks",
        "sampled",
        "sampled-chunks",
        "greedy-eos",
        "sampled-eos",
        "max1",
        "max2-eos",
        "max5",
        "ngram-greedy",
        "ngram-t0.7",
        "ngram-greedy-eos-max13",
        "ngram-t0.7-eos-max7",
        "ngram-max1",
        "hybrid-greedy",
        "hybrid-t0.7",
        "hybrid-sampled-max13",
        "hybrid-greedy-eos-max11",
        "hybrid-t0.7-eos-max7",
    ],
)
def test_device_loop_repeats_the_per_step_path_exactly(models, prompts, monkeypatch, draft, sampling, max_new, eos_at):
    _, jx = models
    ids, mask = prompts
    # adaptive=False: the per-step path drafts every step, so the resident loop's schedule must too
    kw = dict(max_new_tokens=max_new, num_draft_tokens=G, pad_token_id=0, adaptive=False, **sampling)
    if eos_at is not None:  # an EOS id from row 0's own output (None: the model's own EOS, id 2)
        first = speculative_generate(jx["target"], make_drafter(draft, jx), ids, mask, **kw)
        kw["eos_token_id"] = int(first.sequences[0, ids.shape[1] + eos_at])
    (got, got_stats, got_calls), (want, want_stats, want_calls), programs = _both_paths(
        jx, draft, ids, mask, monkeypatch, **kw
    )
    assert got.sequences.tolist() == want.sequences.tolist()
    assert got.num_new_tokens.tolist() == want.num_new_tokens.tolist()
    assert got_stats == want_stats
    assert got_calls == want_calls  # each step's tokens per row, in order
    assert got.stats.adapter_copies == 0
    assert programs == -(-want.stats.steps // jax_loop.STREAM_STEPS)  # on_tokens: one program per chunk
    if eos_at is not None:
        assert got.num_new_tokens[0] == eos_at + 1 < max_new
    if draft == "ngram" and max_new > 1:  # not vacuous: the lookups proposed
        assert got.stats.draft_tokens_proposed > 0


@pytest.mark.parametrize(
    "draft, sampling, max_new, eos_at",
    [("close", {}, MAX_NEW, None), ("far", _SAMPLED, MAX_NEW, 2), ("ngram", {}, 13, 4), ("hybrid", _SAMPLED_07, 7, 2)],
    ids=["greedy", "sampled-eos", "ngram-eos-max13", "hybrid-t0.7-eos"],
)
def test_without_a_callback_the_steps_bookkeeping_is_the_streamed_ones(
    models, prompts, draft, sampling, max_new, eos_at
):
    """With no ``on_tokens`` the host accounts for a chunk's steps at once (``account_steps``, NumPy); the outputs
    and every stat are those of the per-row replay a callback gets (rows ending at EOS and at max_new, rows idle
    in later steps, plain and drafted steps)."""
    _, jx = models
    ids, mask = prompts
    kw = dict(max_new_tokens=max_new, num_draft_tokens=G, pad_token_id=0, **sampling)

    def run(**extra):
        with jax_loop.draft_cost_ratio(1.3):  # the same schedule for every call: plain and drafted steps
            out = speculative_generate(jx["target"], make_drafter(draft, jx), ids, mask, **kw, **extra)
        return out, {k: v for k, v in out.stats.as_dict().items() if k not in _TIMINGS}

    if eos_at is not None:  # an EOS id from row 0's own output under the same schedule
        kw["eos_token_id"] = int(run()[0].sequences[0, ids.shape[1] + eos_at])
    at_once, at_once_stats = run()
    streamed, streamed_stats = run(on_tokens=lambda b, t: None)
    assert at_once.sequences.tolist() == streamed.sequences.tolist()
    assert at_once.num_new_tokens.tolist() == streamed.num_new_tokens.tolist()
    assert at_once_stats == streamed_stats
    assert len(set(at_once.num_new_tokens.tolist())) > 1 or eos_at is None  # rows ended apart


@pytest.mark.parametrize("seed", range(4))
def test_accounting_steps_at_once_is_accounting_them_one_by_one(seed):
    """``_JaxRun.account_steps`` (a chunk's S steps in NumPy) against :meth:`account` per active row and
    :meth:`end_step` per step (the streamed replay), on random records: plain and drafted steps, rows idle
    from some step on, every count in [0, G]; the stats, per-position counts and outputs are the same."""
    from specjax.generate.loop import SpeculativeStats, _Row

    rng = np.random.default_rng(seed)
    b, steps, g = 6, 20, G

    def fresh():
        run = object.__new__(jax_loop._JaxRun)  # the bookkeeping's state alone
        run.stats, run.g, run.on_tokens = SpeculativeStats(drafter="x"), g, None
        run.tested, run.passed = np.zeros(g, np.int64), np.zeros(g, np.int64)
        run.gained = run.row_steps = run.step = 0
        run.rows = [_Row(i) for i in range(b)]
        return run

    k = np.where(rng.random((steps, 1)) < 0.6, rng.integers(1, g + 1, (steps, b)), 0)
    n = np.minimum(rng.integers(0, g + 1, (steps, b)), k)
    e = n + 1 - (rng.random((steps, b)) < 0.2) * n  # an EOS or max_new may cut a step's tokens short
    e[rng.integers(1, steps, b)[None, :] <= np.arange(steps)[:, None]] = 0  # each row idle from its own step on
    out = rng.integers(0, 1000, (b, steps * (g + 1))).astype(np.int32)
    one, many = fresh(), fresh()
    offset = np.zeros(b, np.int64)
    for s in range(steps):
        for row in np.nonzero(e[s] > 0)[0]:
            one.account(
                int(row), int(k[s, row]), int(n[s, row]), out[row, offset[row] : offset[row] + e[s, row]].tolist()
            )
            offset[row] += e[s, row]
        one.end_step(k[s])
    many.account_steps(out, np.zeros(b, np.int64), k, n, e)
    assert many.stats.as_dict() == one.stats.as_dict()
    assert (many.tested.tolist(), many.passed.tolist()) == (one.tested.tolist(), one.passed.tolist())
    assert [r.generated for r in many.rows] == [r.generated for r in one.rows]
    assert (many.gained, many.row_steps, many.step) == (one.gained, one.row_steps, one.step)
    assert one.stats.draft_tokens_accepted > 0 and one.tested.sum() > 0  # not vacuous


class _OwnNgram(NgramDrafter):
    """The built-in rule under another type: the loop cannot know it still is the rule, so it asks the host."""


@pytest.mark.parametrize("kind", ["alone", "hybrid"])
def test_other_lookup_drafters_keep_the_per_step_path(models, prompts, monkeypatch, kind):
    _, jx = models
    ids, mask = prompts
    wrap = (lambda d: d) if kind == "alone" else (lambda d: HybridDrafter(d, ModelDrafter(jx["close"])))
    kw = dict(max_new_tokens=MAX_NEW, num_draft_tokens=G, adaptive=False)  # the per-step path drafts every step
    want = speculative_generate(jx["target"], wrap(NgramDrafter()), ids, mask, **kw)
    programs = _counting_programs(monkeypatch)
    got = speculative_generate(jx["target"], wrap(_OwnNgram()), ids, mask, **kw)
    assert programs == []
    assert got.sequences.tolist() == want.sequences.tolist()
    assert got.stats.draft_tokens_accepted == want.stats.draft_tokens_accepted


@pytest.mark.parametrize("draft", ["far", "ngram", "hybrid"])
def test_device_loop_without_a_callback_is_one_program(models, prompts, monkeypatch, draft):
    """Nothing needs the host between steps: every step of the call in one program, the host reading once."""
    cpu, jx = models
    ids, mask = prompts
    programs = _counting_programs(monkeypatch)
    drafter = make_drafter(draft, jx)
    kw = dict(max_new_tokens=MAX_NEW, num_draft_tokens=G, adaptive=False)  # a schedule measures in chunks, once
    out = speculative_generate(jx["target"], drafter, ids, mask, **kw)
    assert out.sequences[:, ids.shape[1] :].tolist() == target_greedy(cpu["target"], ids, mask, MAX_NEW)
    assert out.stats.steps > jax_loop.STREAM_STEPS  # many steps ...
    assert programs == [1]  # ... one program


def test_nearby_max_new_tokens_share_the_device_loops_compilation(models, prompts):
    """``max_new_tokens`` is an argument of the device-resident program (its buffers are sized in blocks):
    a call with another value in the same block compiles nothing."""
    _, jx = models
    ids, mask = prompts
    speculative_generate(jx["target"], jx["close"], ids, mask, max_new_tokens=9, num_draft_tokens=G)
    with measure_compiles() as clock:
        out = speculative_generate(jx["target"], jx["close"], ids, mask, max_new_tokens=11, num_draft_tokens=G)
    assert out.num_new_tokens.max() == 11
    assert clock.compiles == 0


@pytest.mark.parametrize("ratio", [float("inf"), 1.6], ids=["plain", "mixed"])
@pytest.mark.parametrize("draft", ["close", "far", "ngram", "hybrid"])
def test_greedy_holds_whatever_the_schedule_chooses(models, prompts, draft, ratio):
    """The device-resident schedule's plain steps (testing no draft token, the draft model not run; the next
    drafted step catches its cache up) give the target's greedy tokens, alone (``inf``: a drafted step only
    after 15 plain ones) and mixed with drafted steps."""
    cpu, jx = models
    ids, mask = prompts
    max_new = 40  # past 15 plain steps: the exploring drafted step too
    with jax_loop.draft_cost_ratio(ratio):
        out = speculative_generate(
            jx["target"], make_drafter(draft, jx), ids, mask, max_new_tokens=max_new, num_draft_tokens=G
        )
    assert out.sequences[:, ids.shape[1] :].tolist() == target_greedy(cpu["target"], ids, mask, max_new)
    assert 0 < out.stats.draft_steps < out.stats.steps  # both kinds of step ran
    if ratio == float("inf"):
        assert out.stats.draft_steps <= -(-out.stats.steps // (jax_loop._EXPLORE + 1))


def test_a_plain_step_draws_what_a_step_testing_no_draft_token_draws(models, prompts):
    """Sampled: with every step plain the tokens are those of the per-step path with G = 0 draft tokens tested
    (the same keys, step numbers and emitted-token draw): the plain step is the acceptance step's k = 0 case."""
    _, jx = models
    ids, mask = prompts
    kw = dict(max_new_tokens=12, num_draft_tokens=G, temperature=1.0, top_k=20, seed=4, pad_token_id=0)
    with jax_loop.draft_cost_ratio(float("inf")):
        plain = speculative_generate(jx["target"], jx["close"], ids, mask, **kw)
    assert plain.stats.draft_steps == 0
    with per_step_loop():
        want = speculative_generate(jx["target"], NgramDrafter(min_n=5, max_n=5), ids, mask, adaptive=False, **kw)
    assert want.stats.draft_tokens_proposed == 0  # no 5-gram repeats here: k = 0 every step
    assert plain.sequences.tolist() == want.sequences.tolist()


def test_a_catch_up_leaves_the_draft_cache_as_feeding_every_step_would():
    """Plain steps do not run the draft model; the next drafted step first rewrites each row's last C
    positions from its committed tokens (jax_loop._catch_up). The draft's logits after that step's usual
    forward (the row's last two tokens) equal those from a cache fed every token, for a row 12 plain steps
    behind and one with fewer than C tokens in all; the stale positions held other tokens. Without the
    catch-up they differ."""
    import jax
    import jax.numpy as jnp

    from specjax.generate.jax_model import jax_model

    d = jax_model("draft", tiny_llama(seed=7, layers=1, hidden=32))
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 256, 30), rng.integers(0, 256, 6)]
    behind = [12, 3]  # plain steps since the row's draft cache was last fed
    start = np.array([len(q) - 1 for q in seqs], np.int32)  # each row's last token's position
    context = np.zeros((2, 64), np.int32)
    full, stale = np.zeros((2, 29), np.int32), rng.integers(0, 256, (2, 29)).astype(np.int32)
    for b, q in enumerate(seqs):
        context[b, : len(q)] = q
        full[b, : len(q) - 1] = q[:-1]
        fed = len(q) - 2 - behind[b]  # the positions the cache got before the plain steps
        stale[b, :fed] = q[:fed]
    fwd = jax.jit(lambda c, t, s: d.forward(d.weights, c, t, s, 1))
    caches = [jax_loop.prefill(d, d.weights, d.init_cache(2, 64), jnp.asarray(a)) for a in (full, stale, stale)]
    caches[1] = jax.jit(lambda c: jax_loop._catch_up(d, d.weights, c, jnp.asarray(context), jnp.asarray(start)))(
        caches[1]
    )
    pair = np.stack([[q[-2], q[-1]] for q in seqs]).astype(np.int32)
    want, caught, left = (np.asarray(fwd(c, jnp.asarray(pair), jnp.asarray(start - 1))[0][:, -1]) for c in caches)
    np.testing.assert_allclose(caught, want, atol=1e-5, rtol=0)
    assert np.abs(left - want).max(axis=-1).min() > 1e-3  # each row's logits wrong without it


def test_the_schedule_drafts_while_it_pays():
    """drafts_next: a drafted step makes the CPU schedule's expected tokens at B = 1 (schedule.expected_call_gain,
    Leviathan et al.'s expectation) with every position passing with a = (passed + 1) / (tested + 2); it drafts
    when that beats the cost ratio, always at a ratio of 0, and after 15 plain steps."""
    from specjax.generate.jax_loop import drafts_next
    from specjax.generate.schedule import expected_call_gain

    def e(tested, passed, g=4):
        return expected_call_gain(np.full((1, g), (passed + 1) / (tested + 2)), np.array([g]), None)

    assert bool(drafts_next(0.0, 0.0, 0, 0.0, 4))
    assert bool(drafts_next(100.0, 0.0, 0, 0.0, 4))  # nothing accepted, yet a free draft is taken
    for tested, passed in ((10.0, 8.0), (3.0, 1.0), (40.0, 5.0)):
        assert bool(drafts_next(tested, passed, 0, e(tested, passed) - 1e-3, 4))
        assert not bool(drafts_next(tested, passed, 0, e(tested, passed) + 1e-3, 4))
    assert not bool(drafts_next(10.0, 1.0, 14, 3.0, 4))
    assert bool(drafts_next(10.0, 1.0, 15, 3.0, 4))  # exploring


def test_in_a_batch_the_schedule_prices_a_draft_by_the_calls_last_row():
    """B > 1: drafts_next prices a drafted step as the CPU schedule does (schedule.expected_call_gain: how much
    sooner the call's last row ends, R / E[max_b N_b], from the rows' draft lengths and remaining tokens), in
    float32 on the device: the same decision either side of the host's value; and 32 level rows that each
    make 1.7 tokens a drafted step are worth fewer to the call (their slowest row sets its length), so at a
    cost of 1.5 plain steps one row drafts and 32 do not."""
    import jax.numpy as jnp

    from specjax.generate.jax_loop import drafts_next
    from specjax.generate.schedule import expected_call_gain

    caps = np.array([4, 4, 3, 4, 0, 4, 2, 4])
    remaining = np.array([60, 12, 3, 64, 0, 40, 2, 30])
    for tested, passed in ((10.0, 8.0), (30.0, 12.0), (40.0, 5.0)):
        a = (passed + 1) / (tested + 2)
        e = expected_call_gain(np.full((8, 4), a), caps, remaining)
        for ratio, want in ((e * 0.99, True), (e * 1.01, False)):
            got = drafts_next(tested, passed, 0, ratio, 4, jnp.asarray(caps), jnp.asarray(remaining))
            assert bool(got) == want, (tested, passed, e, ratio)
    one = drafts_next(10.0, 4.0, 0, 1.5, 4, jnp.full(1, 4), jnp.full(1, 64))  # a = 5/12: 1.70 tokens a step
    many = drafts_next(10.0, 4.0, 0, 1.5, 4, jnp.full(32, 4), jnp.full(32, 64))
    assert bool(one) and not bool(many)


def test_the_device_resident_step_has_no_scatter(models, prompts, monkeypatch):
    """The device-resident program writes caches, buffers and records by selects and slice updates: no
    scatter, which a TPU runs as a loop over its indices (the per-row cache writes took 6 of a B = 32 token's
    6.75 ms on the chip; benchmarks/results/tpu-loop/profile-399f863.log). The program is lowered as it runs
    (the call goes through); the hybrid drafter's has the draft model's steps and catch-up and the lookup's."""
    _, jx = models
    ids, mask = prompts
    texts = []
    run = jax_loop.resident_steps

    def lowered(*args, **kwargs):
        texts.append(run.lower(*args, **kwargs).as_text())
        return run(*args, **kwargs)

    monkeypatch.setattr(jax_loop, "resident_steps", lowered)
    speculative_generate(jx["target"], make_drafter("hybrid", jx), ids, mask, max_new_tokens=8, num_draft_tokens=G)
    assert texts and all("stablehlo.while" in t for t in texts)  # the resident program, lowered
    assert not [t for t in texts if "stablehlo.scatter" in t]


@pytest.mark.parametrize("draft", ["close", "ngram"])
def test_greedy_holds_with_the_tpus_bfloat16_caches(models, prompts, monkeypatch, draft):
    """With the caches kept in bfloat16 (a TPU's choice at its default precision, ``jax_model.cache_dtype``,
    forced here), the loop's greedy output is still the target alone's with the same caches."""
    _, jx = models
    ids, mask = prompts
    monkeypatch.setattr(jax_model, "cache_dtype", lambda *args: np.dtype(jnp.bfloat16))
    want = greedy_decode(jx["target"], ids, mask, MAX_NEW).tolist()
    out = speculative_generate(
        jx["target"], make_drafter(draft, jx), ids, mask, max_new_tokens=MAX_NEW, num_draft_tokens=G
    )
    assert out.sequences[:, ids.shape[1] :].tolist() == want
    assert out.stats.draft_tokens_proposed > 0


def test_appending_to_the_device_buffers_is_a_scatter_with_drops():
    """jax_loop._append writes each row's first e[b] tokens from length[b] on, dropping slots past the
    buffer, exactly as a scatter with mode="drop" does (it is written as selects: a TPU loops over a
    scatter's indices)."""
    import jax
    import jax.numpy as jnp

    from specjax.generate.jax_loop import _append

    rng = np.random.default_rng(0)
    b, w, g1 = 6, 12, 5
    buffer = jnp.asarray(rng.integers(0, 100, (b, w)), jnp.int32)
    tokens = jnp.asarray(rng.integers(100, 200, (b, g1)), jnp.int32)
    length = jnp.asarray([0, 3, 7, 9, 12, 11], jnp.int32)  # rows 3-5 run past the buffer's end
    e = jnp.asarray([5, 1, 5, 5, 2, 0], jnp.int32)
    j = jnp.arange(g1)[None, :]
    slot = jnp.where(j < e[:, None], length[:, None] + j, w)
    want = buffer.at[jnp.arange(b)[:, None], slot].set(tokens, mode="drop")
    got = jax.jit(_append)(buffer, length, tokens, e)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(buffer))


def test_the_measured_cost_ratio_leaves_out_a_chunks_fixed_cost():
    """step_cost_ratio: chunks of 8 steps at 3 and 2 ms a step, each with 10 ms of dispatch and host read (what
    a chunk of no steps takes): a drafted step costs 1.5 plain steps, not the chunks' 34 / 26 ms (1.31, the
    ratio that made the chip's batch draft where drafting lost). The fastest chunk of each kind counts; no
    chunk of a kind, or no time beyond the fixed cost, measures nothing."""
    from specjax.generate.jax_loop import step_cost_ratio

    drafted, plain, fixed = [(0.034, 8), (0.036, 8)], [(0.026, 8), (0.0261, 8)], [0.0101, 0.010]
    assert step_cost_ratio(drafted, plain, fixed) == pytest.approx(1.5)
    assert step_cost_ratio([(0.010 + 0.003 * 5, 5)], [(0.010 + 0.002 * 3, 3)], [0.010]) == pytest.approx(1.5)
    assert step_cost_ratio(drafted, [], fixed) is None
    assert step_cost_ratio(drafted, plain, []) is None
    assert step_cost_ratio(drafted, [(0.009, 8)], fixed) is None


def test_the_schedule_measures_its_costs_once_per_program(models, prompts):
    """adaptive=True (the default): the first call that does not compile times drafted and plain steps and
    keeps their ratio for the program; later calls use it. Greedy output is the target's throughout."""
    cpu, jx = models
    ids, mask = prompts
    want = target_greedy(cpu["target"], ids, mask, 30)
    drafter = jx["far"]
    for _ in range(3):
        out = speculative_generate(jx["target"], drafter, ids, mask, max_new_tokens=30, num_draft_tokens=2)
        assert out.sequences[:, ids.shape[1] :].tolist() == want
    from specjax.generate.jax_model import jax_model

    ratios = [r for key, r in jax_loop._RATIOS[jax_model("target", jx["target"])].items() if key[3] == 2]
    assert len(ratios) == 1 and 0 < ratios[0] < float("inf")


def test_draft_forwards_count_the_steps_that_drafted(models, prompts):
    """A drafted step runs the draft model G times, a plain step not at all."""
    _, jx = models
    ids, mask = prompts
    kw = dict(max_new_tokens=12, num_draft_tokens=G)
    with jax_loop.draft_cost_ratio(0.0):
        every = speculative_generate(jx["target"], jx["far"], ids, mask, **kw)
    with jax_loop.draft_cost_ratio(float("inf")):  # 12 tokens: fewer than 15 plain steps, none drafts
        plain = speculative_generate(jx["target"], jx["far"], ids, mask, **kw)
    assert every.stats.draft_forwards == G * every.stats.steps + 1  # + the prefill
    assert plain.stats.draft_forwards == 1  # the prefill alone


@pytest.mark.parametrize(
    ("temperatures", "want"), [([0.0, 0.0], True), ([0.0, 0.7], False), ([1.0], False), ([], False)]
)
def test_a_call_is_marked_all_greedy_only_when_every_row_is(temperatures, want):
    """jax_loop.known_greedy sets the static ``all_greedy`` exactly for a call whose every row is greedy (a
    sampled row marked so would be verified by the argmax off the CPU)."""
    from specjax.drafters.base import SamplingState
    from specjax.kernels.types import SamplingParams

    sampling = SamplingState(SamplingParams(jnp.asarray(temperatures, jnp.float32)), jnp.zeros((len(temperatures),)))
    marked = jax_loop.known_greedy(sampling)
    assert marked.params.all_greedy is want
    assert np.array_equal(np.asarray(marked.params.temperature), np.asarray(sampling.params.temperature))


@pytest.mark.parametrize("draft", ["close", "ngram", "hybrid"])
def test_greedy_holds_with_the_tpus_branches_of_an_all_greedy_call(models, prompts, monkeypatch, draft):
    """Traced as a TPU lowers it (every ``lax.platform_dependent`` on its TPU or default branch), an all-greedy
    call (``SamplingParams.all_greedy``, static) draws the draft's tokens and verifies by the argmax alone, with
    no branch for sampled rows, and gives the target alone's tokens with the acceptance of the CPU's branches
    (the same drafts). The jit caches are cleared around the TPU-branch call, so that it traces anew and
    leaves nothing behind (the last test of the file: later ones here would trace again)."""
    from jax import lax

    from specjax.kernels import steps

    _, jx = models
    ids, mask = prompts
    want = greedy_decode(jx["target"], ids, mask, MAX_NEW).tolist()
    kw = dict(max_new_tokens=MAX_NEW, num_draft_tokens=5)
    on_cpu = speculative_generate(jx["target"], make_drafter(draft, jx), ids, mask, **kw)  # the CPU's branches
    argmaxes = []

    def tpu_branch(*args, default, **platforms):
        return platforms["tpu"](*args) if "tpu" in platforms else default(*args)

    def counted(x):
        argmaxes.append(x.shape)
        return first_argmax(x)

    first_argmax = steps.first_argmax
    monkeypatch.setattr(lax, "platform_dependent", tpu_branch)
    monkeypatch.setattr(steps, "first_argmax", counted)
    jax.clear_caches()
    try:
        out = speculative_generate(jx["target"], make_drafter(draft, jx), ids, mask, **kw)
    finally:
        jax.clear_caches()
    assert out.sequences[:, ids.shape[1] :].tolist() == want
    assert out.stats.draft_tokens_proposed > 0
    # the same drafts, the same acceptance: the static argmax draws what the statistics' branch draws
    assert (out.stats.steps, out.stats.draft_tokens_accepted) == (
        on_cpu.stats.steps,
        on_cpu.stats.draft_tokens_accepted,
    )
    assert bool(argmaxes) == (draft != "ngram")  # the draft model's draws took the static argmax
