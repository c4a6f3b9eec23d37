"""The adaptive draft length's decisions (specjax.generate.schedule) on given costs and outcomes.

No timing is measured here: costs are recorded by hand, so each decision is
determined and each test can fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from specjax.generate.schedule import (
    EXPLORE_BACKOFF,
    EXPLORE_EVERY,
    EXPLORE_PLAIN_AFTER,
    DraftSchedule,
    expected_call_gain,
)


def schedule(
    verify_ms: dict[int, float], draft_ms: float = 0.0, overhead_ms: float = 1.0, batch: int = 1, g: int = 6
) -> DraftSchedule:
    s = DraftSchedule(batch, g, adaptive=True, draft_cost_hint=draft_ms / 1000)
    for q, ms in verify_ms.items():
        for _ in range(3):  # the first time of each cost counts as warm-up
            s.record_verify(q, ms / 1000)
    for _ in range(3):
        s.record_overhead(overhead_ms / 1000)
        if draft_ms:
            s.record_draft(1, draft_ms / 1000)
    return s


CPU_LIKE = {1: 40.0, 2: 66.0, 3: 82.0, 4: 56.0, 5: 57.0, 6: 58.0, 7: 85.0, 8: 58.0}


def test_a_single_rows_gain_is_leviathans_expectation():
    """At B = 1 the call's gain is ``1 + Σ_{i<k} Π_{j≤i} p_j`` (Leviathan et al. 2023, eq. 1)."""

    def one(probs, k):
        return expected_call_gain(np.array([probs], float).reshape(1, -1), np.array([k]), np.array([9.0]))

    half = [0.5] * 4
    assert one(half, 0) == pytest.approx(1.0)
    assert one(half, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert one([1.0] * 4, 4) == pytest.approx(5.0)
    # one probability per position: a token after an unlikely one adds little
    assert one([0.9, 0.1, 0.9], 3) == pytest.approx(1 + 0.9 + 0.09 + 0.081)
    assert one([0.9, 0.9, 0.9], 3) == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    assert one([], 0) == 1.0


def test_free_drafts_with_good_acceptance_are_verified():
    s = schedule(CPU_LIKE)
    for _ in range(5):
        s.record_outcome(np.array([4]), np.array([4]))  # everything accepted
    assert s.plan(np.array([6]), np.array([True])).tolist() == [6]
    assert s.trim(np.array([3]), np.array([True])).tolist() == [3]


def test_a_drafter_that_is_never_accepted_is_not_used():
    s = schedule(CPU_LIKE, draft_ms=3.0)
    for _ in range(8):
        s.record_outcome(np.array([4]), np.array([0]))
    assert s.plan(np.array([6]), np.array([True])).tolist() == [0]
    # ... until it has not drafted for EXPLORE_EVERY steps: then it looks again, with 1 token
    for _ in range(EXPLORE_EVERY - 1):
        s.record_outcome(np.array([0]), np.array([0]))
    assert s.plan(np.array([6]), np.array([True])).tolist() == [0]
    s.record_outcome(np.array([0]), np.array([0]))
    assert s.plan(np.array([6]), np.array([True])).tolist() == [1]
    assert s.trim(np.array([3]), np.array([True])).tolist() == [1]
    # negative control: the same costs with good acceptance draft
    good = schedule(CPU_LIKE, draft_ms=3.0)
    for _ in range(8):
        good.record_outcome(np.array([4]), np.array([4]))
    assert good.plan(np.array([6]), np.array([True]))[0] > 0


def test_expensive_drafting_is_shortened():
    """A draft token costing half a target forward: the best width is short."""
    s = schedule(CPU_LIKE, draft_ms=20.0)
    for _ in range(8):
        s.record_outcome(np.array([3]), np.array([2]))
    w = int(s.plan(np.array([6]), np.array([True]))[0])
    cheap = schedule(CPU_LIKE, draft_ms=0.5)
    for _ in range(8):
        cheap.record_outcome(np.array([3]), np.array([2]))
    assert w < int(cheap.plan(np.array([6]), np.array([True]))[0])


def test_slow_widths_are_padded_to_cheaper_ones():
    s = schedule(CPU_LIKE)
    assert s.padded_width(3) == 4  # 82 ms > 56 ms
    assert s.padded_width(7) == 8
    assert s.padded_width(5) == 5
    assert s.padded_width(1) == 1


def test_unmeasured_wider_shapes_are_tried_once():
    """Widths from the needed one up to G + 2 are each run until timed (once per model and batch
    size), so the costs a confident drafter's short and long drafts are priced by are measured."""
    s = schedule({1: 40.0, 2: 66.0, 3: 82.0})  # G = 6: widths up to 8
    assert s.padded_width(3) == 4  # 4 has no time yet: learn it
    for _ in range(3):
        s.record_verify(4, 0.090)  # slower than 3
    assert s.padded_width(3) == 5  # then 5
    for q in range(5, 9):
        assert s.padded_width(3) == q
        for _ in range(2):
            s.record_verify(q, 0.095)
    assert s.padded_width(3) == 3  # all measured, none cheaper
    s.record_verify(5, 0.050)
    s.record_verify(5, 0.050)  # 5 now cheaper than 3 (82 ms)
    assert s.padded_width(3) == 5
    assert s.padded_width(2) == 2  # 5 is three wider than 2: not a padding candidate


def test_a_width_still_being_learned_does_not_price_the_decision():
    """Learning a width is a one-time cost of a step that drafts anyway: the step runs the wider
    width, but the decision to draft is priced at the width it needs. Here 3 has no time yet and
    its estimate, the line between 2 (52 ms) and 4 (measured at 200 ms), is 126 ms."""
    s = schedule({1: 50.0, 2: 52.0, 4: 200.0}, draft_ms=1.0)
    for _ in range(6):
        s.record_outcome(np.array([1]), np.array([1]))  # every draft token passed
    assert s.padded_width(2) == 3  # the step learns width 3 ...
    assert s.priced_width(2) == 2  # ... but is priced as the 52 ms it needs
    assert s.plan(np.array([1]), np.array([True])).tolist() == [1]
    # negative control: priced at the width being learned, 1.9 tokens for 128 ms loses to 1 for 51
    assert s._verify_cost(s.padded_width(2)) > 2 * s._verify_cost(1)


def test_the_first_time_of_a_shape_is_ignored():
    s = DraftSchedule(1, 4, adaptive=True, draft_cost_hint=0.0)
    s.record_verify(1, 0.040)
    s.record_verify(4, 5.0)  # a warm-up call: torch's first call at a shape
    s.record_verify(4, 0.050)
    assert s._verify_cost(4) == pytest.approx(0.050)


def test_caps_are_never_exceeded_and_fixed_schedule_is_the_caps():
    s = schedule(CPU_LIKE, batch=4)
    caps = np.array([0, 1, 6, 3])
    active = np.array([False, True, True, True])
    assert np.all(s.plan(caps, active) <= caps)
    fixed = DraftSchedule(4, 6, adaptive=False, draft_cost_hint=0.0)
    assert fixed.plan(caps, active).tolist() == caps.tolist()
    assert fixed.trim(np.array([0, 1, 2, 3]), active).tolist() == [0, 1, 2, 3]


def test_rows_that_stop_drafting_forget_slowly():
    s = schedule(CPU_LIKE)
    for _ in range(8):
        s.record_outcome(np.array([4]), np.array([0]))
    low = float(s.alpha()[0])
    for _ in range(150):
        s.record_outcome(np.array([0]), np.array([0]))  # steps without drafting
    assert float(s.alpha()[0]) > low + 0.2


def test_a_plain_step_is_priced_from_the_measured_widths():
    """Before any plain step has a time of its own, it costs what the measured widths imply (not 1 s)."""
    s = schedule({3: 60.0, 4: 62.0}, draft_ms=1.0)
    assert s._verify_cost(1) == pytest.approx(0.060 / 1.24)
    for _ in range(8):
        s.record_outcome(np.array([2]), np.array([0]))  # never accepted
    assert s.plan(np.array([4]), np.array([True])).tolist() == [0]
    good = schedule({3: 60.0, 4: 62.0}, draft_ms=1.0)
    for _ in range(EXPLORE_PLAIN_AFTER - 1):  # (then it would try a plain step: the next test)
        good.record_outcome(np.array([2]), np.array([2]))
    assert good.plan(np.array([4]), np.array([True]))[0] > 0


def test_plain_and_drafting_steps_keep_their_own_overheads():
    s = DraftSchedule(1, 4, adaptive=True, draft_cost_hint=0.0)
    for _ in range(3):
        s.record_overhead(0.010, drafted=True)
    assert s._overhead(False) == pytest.approx(0.010)  # the other kind's until measured
    for _ in range(3):
        s.record_overhead(0.001, drafted=False)
    assert (s._overhead(True), s._overhead(False)) == pytest.approx((0.010, 0.001))


def test_plain_steps_are_tried_while_they_have_no_time():
    """Drafting pays on the prior, but a plain step has no time of its own: every
    EXPLORE_PLAIN_AFTER-th drafting step is a plain one until two plain steps were timed."""
    s = DraftSchedule(1, 4, adaptive=True, draft_cost_hint=0.0)
    for _ in range(3):
        s.record_verify(5, 0.010)
        s.record_overhead(0.001)
    caps, active = np.array([4]), np.array([True])
    for _ in range(EXPLORE_PLAIN_AFTER - 1):
        assert s.plan(caps, active)[0] > 0  # negative control: not yet
        s.record_outcome(np.array([4]), np.array([2]))
    s.record_outcome(np.array([4]), np.array([2]))
    assert s.plan(caps, active).tolist() == [0]
    assert s.trim(np.array([4]), active).tolist() == [0]
    s.record_verify(1, 0.020)  # warm-up time
    s.record_outcome(np.array([0]), np.array([0]))
    for _ in range(EXPLORE_PLAIN_AFTER):
        s.record_outcome(np.array([4]), np.array([2]))
    assert s.plan(caps, active).tolist() == [0]  # one time is still the warm-up's
    s.record_verify(1, 0.009)
    for _ in range(EXPLORE_PLAIN_AFTER + 3):
        s.record_outcome(np.array([4]), np.array([2]))
    # measured: 5 tokens (~2.3 expected) in 10 ms beat 1 in 9 ms, so it drafts again
    assert s.plan(caps, active)[0] > 0


class _Model:
    """Stands for a target model: the schedule shares timings per model object and batch size."""


def test_costs_follow_the_batch_size_when_rows_leave():
    model = _Model()
    s = DraftSchedule(4, 4, adaptive=True, draft_cost_hint=0.0, model=model)
    for _ in range(3):
        s.record_verify(5, 0.040)
    assert s._estimate(("verify", 5)) == pytest.approx(0.040)
    s.select_rows([0, 2])
    assert s._estimate(("verify", 5)) is None  # two rows cost less than four: not the same table
    for _ in range(3):
        s.record_verify(5, 0.015)
    later = DraftSchedule(2, 4, adaptive=True, draft_cost_hint=0.0, model=model)
    assert later._estimate(("verify", 5)) == pytest.approx(0.015)
    assert DraftSchedule(4, 4, adaptive=True, draft_cost_hint=0.0, model=model)._estimate(
        ("verify", 5)
    ) == pytest.approx(0.040)


def test_the_shared_tables_let_go_of_a_freed_model():
    """A long-lived process loads and drops models: their timings and tallies go with them."""
    import gc

    from specjax.generate import schedule

    gc.collect()  # models of earlier tests, freed now rather than during this test's count
    before = (len(schedule._SHARED), len(schedule._CARRIED))
    models = [_Model() for _ in range(3)]
    for m in models:
        DraftSchedule(2, 4, adaptive=True, draft_cost_hint=0.0, model=m, drafter_key="ngram", greedy=True)
    assert (len(schedule._SHARED), len(schedule._CARRIED)) == (before[0] + 3, before[1] + 3)
    del models, m
    gc.collect()
    assert (len(schedule._SHARED), len(schedule._CARRIED)) == before


def test_free_lookups_and_paid_drafts_are_learned_apart():
    """A hybrid's n-gram rows pass, its model's fail: pay for no model draft, keep verifying lookups."""
    free = np.array([True])
    s = schedule(CPU_LIKE, draft_ms=3.0)
    for _ in range(6):
        s.record_outcome(np.array([4]), np.array([4]), free)  # lookups: all accepted
        s.record_outcome(np.array([4]), np.array([0]), ~free)  # the model's drafts: none
    assert s.plan(np.array([6]), np.array([True])).tolist() == [0]
    assert s.trim(np.array([4]), np.array([True]), free).tolist() == [4]
    assert s.trim(np.array([4]), np.array([True]), ~free).tolist() == [0]
    assert float(s.alpha(free)[0]) > 0.8 > 0.2 > float(s.alpha()[0])
    # negative control: without the marks both kinds mix into one estimate, and the
    # model's drafts look worth paying for
    mixed = schedule(CPU_LIKE, draft_ms=3.0)
    for _ in range(6):
        mixed.record_outcome(np.array([4]), np.array([4]))
        mixed.record_outcome(np.array([4]), np.array([0]))
    assert mixed.plan(np.array([6]), np.array([True]))[0] > 0


def test_hindsight_counts_as_tests_of_the_drafters_own_kind():
    s = schedule(CPU_LIKE, draft_ms=3.0)
    for _ in range(8):
        s.record_outcome(np.array([4]), np.array([0]))  # drafts that fail: it stops paying
    assert s.plan(np.array([6]), np.array([True])).tolist() == [0]
    s.record_hindsight(np.array([20]), np.array([20]))  # then, in plain steps, it would have been right
    assert s.plan(np.array([6]), np.array([True]))[0] > 0
    assert float(s.alpha(np.array([True]))[0]) == pytest.approx(0.6)  # the free kind's prior: untouched


def test_paid_drafts_widen_with_the_evidence():
    s = schedule(CPU_LIKE, draft_ms=0.5)
    assert s.plan(np.array([6]), np.array([True])).tolist() == [1]  # the prior alone: one token
    s.record_outcome(np.array([1]), np.array([1]))
    assert s.plan(np.array([6]), np.array([True])).tolist() == [2]
    for _ in range(4):
        s.record_outcome(np.array([2]), np.array([2]))
    assert s.plan(np.array([6]), np.array([True]))[0] > 2
    # free proposals are trimmed by the estimate alone (nothing was paid for them)
    fresh = schedule(CPU_LIKE)
    assert fresh.trim(np.array([6]), np.array([True]))[0] > 1


def test_rows_without_proposals_count_in_the_batch():
    """B = 8, one row has a good lookup: widening the whole batch's forward for it does not pay."""
    costs = {1: 40.0, 2: 60.0, 3: 66.0, 4: 70.0, 5: 72.0}
    active = np.ones(8, bool)
    one = schedule(costs, batch=8, g=4)
    for _ in range(6):
        one.record_outcome(np.array([4] + [0] * 7), np.array([4] + [0] * 7))
    assert one.trim(np.array([4] + [0] * 7), active).tolist() == [0] * 8
    # negative control: every row with such a lookup
    every = schedule(costs, batch=8, g=4)
    for _ in range(6):
        every.record_outcome(np.full(8, 4), np.full(8, 4))
    assert every.trim(np.full(8, 4), active).max() > 0


def simulated_call_gain(probs: np.ndarray, k: np.ndarray, remaining: np.ndarray, calls: int = 4000) -> float:
    """R / E[steps until every row has its tokens], drafting ``k`` at every step (as the loop does, never past
    what a row still needs), over ``calls`` simulated calls."""
    rng = np.random.default_rng(1)
    n, g = probs.shape
    left = np.tile(np.asarray(remaining, np.int64), (calls, 1))
    steps = np.zeros(calls)
    while (left > 0).any():
        live = left > 0
        tested = np.minimum(k[None, :], np.maximum(left - 1, 0))
        passed = rng.random((calls, n, g)) < probs
        gained = 1 + np.where(np.arange(g) < tested[..., None], np.cumprod(passed, axis=2), 0).sum(axis=2)
        left = np.where(live, np.maximum(left - gained, 0), 0)
        steps += live.any(axis=1)
    return float(np.max(remaining) / steps.mean())


def test_the_call_gain_is_the_last_rows_not_the_largest_expectation():
    """A step's worth to a batch is R / E[steps of the call's last row] drafting so at every step, checked
    against simulated calls; not the one step's E[R − max_b (r_b − X_b)], which stays near 1 for rows that are
    level (and, drafting never, they stay level)."""
    rng = np.random.default_rng(0)
    probs, k = rng.uniform(0.3, 0.9, (3, 4)), np.array([4, 2, 3])
    for remaining in ([20.0, 20.0, 20.0], [20.0, 19.0, 20.0], [17.0, 20.0, 18.0], [40.0, 6.0, 25.0]):
        r = np.array(remaining)
        assert expected_call_gain(probs, k, r) == pytest.approx(simulated_call_gain(probs, k, r), rel=0.03)
    # one row: 1 + Σ_{i<k} Π_{j≤i} p_j, exactly (Leviathan et al.'s expectation)
    for kk in range(5):
        passed = rng.random((100_000, 4)) < probs[0]
        simulated = 1 + np.where(np.arange(4) < kk, np.cumprod(passed, axis=1), 0).sum(axis=1).mean()
        assert expected_call_gain(probs[:1], np.array([kk]), np.array([20.0])) == pytest.approx(simulated, abs=0.01)
    # eight level rows, each passing half its tokens, 64 tokens to go: a one-token draft at every step takes
    # about 46 steps (1.39 tokens a step; each row expects 1.5), where the one step's view says 1 + 0.5^8
    half, one = np.full((8, 4), 0.5), np.ones(8, np.int64)
    gain = expected_call_gain(half, one, np.full(8, 64.0))
    assert gain == pytest.approx(simulated_call_gain(half, one, np.full(8, 64)), rel=0.03)
    assert gain > 1.3 > 1 + 0.5**8
    # rows far ahead gain the call nothing: the lagging row's own rate (negative control: level rows gain more)
    lagging = expected_call_gain(np.full((2, 4), 0.5), np.array([0, 1]), np.array([64.0, 64.0]))
    assert lagging == pytest.approx(1.0)
    assert expected_call_gain(np.full((2, 4), 0.5), np.array([1, 0]), np.array([10.0, 64.0])) == pytest.approx(1.0)
    assert expected_call_gain(np.full((2, 4), 0.5), np.array([0, 1]), np.array([10.0, 64.0])) > 1.4


def test_a_batch_of_middling_rows_drafts_and_one_of_poor_rows_does_not():
    """Eight level rows that each pass 3 of 4 draft tokens: drafting pays for the batch (its rows spread and the
    lagging ones gain in turn), as for a row alone; rows that pass 1 of 4 decode plainly (negative control)."""
    costs = {1: 40.0, 2: 60.0, 3: 66.0, 4: 70.0, 5: 72.0}
    batch, poor = schedule(costs, batch=8, g=4), schedule(costs, batch=8, g=4)
    alone = schedule(costs, batch=1, g=4)
    left = np.full(8, 64)
    for _ in range(6):
        batch.record_outcome(np.full(8, 4), np.full(8, 3))
        poor.record_outcome(np.full(8, 4), np.full(8, 1))
        alone.record_outcome(np.array([4]), np.array([3]))
    assert batch.trim(np.full(8, 4), np.ones(8, bool), remaining=left).max() > 0
    assert alone.trim(np.array([4]), np.array([True]), remaining=np.array([64])).max() > 0
    assert poor.trim(np.full(8, 4), np.ones(8, bool), remaining=left).max() == 0


def test_acceptance_is_carried_into_later_calls_on_the_same_model_and_drafter():
    """A later call starts from what earlier ones measured: wide at once for a drafter that passes,
    not at all for one that fails; other drafters, sampled calls and other models start from the prior."""
    model, caps, active = _Model(), np.array([6]), np.array([True])

    def fresh(drafter: str, greedy: bool = True, on: object = model) -> DraftSchedule:
        s = DraftSchedule(1, 6, adaptive=True, draft_cost_hint=0.0, model=on, drafter_key=drafter, greedy=greedy)
        for q, ms in CPU_LIKE.items():
            for _ in range(3):
                s.record_verify(q, ms / 1000)
        for _ in range(3):
            s.record_overhead(0.001)
        return s

    first = fresh("good")
    assert first.plan(caps, active).tolist() == [1]  # the prior alone: a narrow first draft
    for _ in range(10):
        first.record_outcome(np.array([6]), np.array([6]))
    assert fresh("good").plan(caps, active).tolist() == [5]  # evidence of 4 tests carried: up to 5 at once
    bad = fresh("bad")
    for _ in range(10):
        bad.record_outcome(np.array([3]), np.array([0]))
    bad.record_hindsight(np.array([0]), np.array([20]))
    assert fresh("bad").plan(caps, active).tolist() == [0]
    # negative controls: what was carried belongs to its model, drafter and kind of call
    assert fresh("bad", greedy=False).plan(caps, active).tolist() == [1]
    assert fresh("bad", on=_Model()).plan(caps, active).tolist() == [1]
    assert fresh("other").plan(caps, active).tolist() == [1]


def test_an_unmeasured_width_between_measured_ones_costs_the_line_between_them():
    """q = 2 unmeasured between q = 1 (16 ms) and q = 3 (24 ms): 20 ms, not the one-sided prior's 17.9 ms
    that made a one-token draft look cheap; beyond the measured widths the prior still scales."""
    s = schedule({1: 16.0, 3: 24.0, 5: 26.0})
    assert s._verify_cost(2) == pytest.approx(0.020)
    assert s._verify_cost(4) == pytest.approx(0.025)
    assert s._verify_cost(7) == pytest.approx(0.026 * (1 + 0.12 * 6) / (1 + 0.12 * 4))
    only_wide = schedule({5: 26.0})  # no plain-step time yet: T(1) inferred from the nearest width
    assert only_wide._verify_cost(1) == pytest.approx(0.026 / (1 + 0.12 * 4))


def test_an_exploring_step_refreshed_by_hindsight_verifies_only_what_pays():
    """After EXPLORE_EVERY plain steps the schedule asks for one token; a drafter that then reports
    fresh failed tests in hindsight gets nothing verified, while without hindsight the token is."""

    def idle() -> DraftSchedule:
        s = schedule(CPU_LIKE, draft_ms=3.0)
        for _ in range(8):
            s.record_outcome(np.array([4]), np.array([0]))
        for _ in range(EXPLORE_EVERY):
            s.record_outcome(np.array([0]), np.array([0]))
        assert s.plan(np.array([6]), np.array([True])).tolist() == [1]
        return s

    s = idle()
    s.record_hindsight(np.array([1]), np.array([10]))
    assert s.trim(np.array([1]), np.array([True])).tolist() == [0]
    s.record_outcome(np.array([0]), np.array([0]))
    assert s.plan(np.array([6]), np.array([True])).tolist() == [0]  # and the next step does not explore again
    assert idle().trim(np.array([1]), np.array([True])).tolist() == [1]  # negative control: no hindsight
    good = idle()  # hindsight that passes: verified
    good.record_hindsight(np.array([10]), np.array([10]))
    assert good.trim(np.array([1]), np.array([True])).tolist() == [1]


def test_exploring_backs_off_while_it_finds_nothing_and_resets_when_drafting_pays():
    s = schedule(CPU_LIKE, draft_ms=3.0)
    caps, active = np.array([6]), np.array([True])
    for _ in range(8):
        s.record_outcome(np.array([4]), np.array([0]))

    def steps_to_explore() -> int:
        n = 0
        while s.plan(caps, active).tolist() != [1]:
            s.record_verify(1, CPU_LIKE[1] / 1000)  # a plain step, timed as the loop does
            s.record_outcome(np.array([0]), np.array([0]))
            n += 1
        s.record_outcome(np.array([1]), np.array([0]))  # the exploring token fails
        return n

    gaps = [steps_to_explore() for _ in range(EXPLORE_BACKOFF + 2)]
    assert gaps == [EXPLORE_EVERY << min(i, EXPLORE_BACKOFF) for i in range(len(gaps))]
    # a step that drafts on the estimates resets the interval
    for _ in range(6):
        s.record_outcome(np.array([4]), np.array([4]))
    assert s.plan(caps, active)[0] > 1
    s.record_outcome(np.array([4]), np.array([4]))
    while s.plan(caps, active)[0] > 0:
        s.record_outcome(np.array([4]), np.array([0]))
    s.record_outcome(np.array([4]), np.array([0]))
    assert steps_to_explore() == EXPLORE_EVERY


def test_a_batch_drafts_for_the_rows_that_lag():
    """The call ends with its last row: a proposal of a row ahead of the others is
    not worth a wider forward, one of the row that lags (or of every row) is."""
    s = schedule(CPU_LIKE, batch=2)
    for _ in range(5):
        s.record_outcome(np.array([4, 4]), np.array([4, 4]))  # both rows' drafts pass
    active = np.array([True, True])
    only_row_0 = np.array([4, 0])
    assert s.trim(only_row_0, active, remaining=np.array([20, 20])).tolist() == [0, 0]  # row 1 still needs 20 steps
    assert s.trim(only_row_0, active, remaining=np.array([10, 20])).tolist() == [0, 0]  # row 0 is ahead
    assert s.trim(only_row_0, active, remaining=np.array([20, 10]))[0] > 0  # row 0 lags: it pays
    assert s.trim(np.array([4, 4]), active, remaining=np.array([20, 20])).min() > 0  # every row gains
    # a finished row's (inactive) remaining and proposal do not count
    assert s.trim(only_row_0, np.array([True, False]), remaining=np.array([20, 30]))[0] > 0


def test_a_close_call_on_an_old_plain_time_times_a_plain_step_again():
    """A plain step timed high once (a noisy call) must not keep a marginal drafter drafting for good."""
    from specjax.generate.schedule import CLOSE_CALL, PLAIN_REFRESH

    def drafting(verify_ms: dict[int, float]) -> DraftSchedule:
        s = schedule(verify_ms)
        for _ in range(5):
            s.record_outcome(np.array([4]), np.array([1]))  # α about 0.5: drafting barely pays
        s.record_verify(1, 0.040)  # a plain step timed now
        return s

    close = drafting({1: 40.0, 2: 62.0, 3: 64.0, 4: 66.0, 5: 68.0})
    clear = drafting({1: 40.0, 2: 42.0, 3: 43.0, 4: 44.0, 5: 45.0})  # negative control: wide margin
    caps, active = np.array([4]), np.array([True])
    for s in (close, clear):
        assert s.plan(caps, active)[0] > 0
    assert close._edge < CLOSE_CALL <= clear._edge
    for _ in range(PLAIN_REFRESH):
        for s in (close, clear):
            w = int(s.plan(caps, active)[0])
            assert w > 0
            s.record_outcome(np.array([w]), np.array([1]))
    assert close.plan(caps, active).tolist() == [0]  # time a plain step again
    assert clear.plan(caps, active)[0] > 0
    close.record_verify(1, 0.040)
    close.record_outcome(np.array([0]), np.array([0]))
    assert close.plan(caps, active)[0] > 0  # timed: drafting again


# --------------------------------------------------------------------------- #
# A drafter's confidence in each token (Proposal.confidence)
# --------------------------------------------------------------------------- #

FLAT = {1: 40.0, 2: 55.0, 3: 56.0, 4: 58.0, 5: 60.0, 6: 62.0, 7: 64.0, 8: 66.0}  # 2 ms more per token past 3


def test_confidence_prices_each_position():
    """The same proposal and costs: verified up to where the drafter's confidence falls, where the
    row's acceptance alone would verify all of it."""
    s = schedule(FLAT)
    for _ in range(6):
        s.record_outcome(np.array([4]), np.array([3]))  # α about 0.8
    proposed, active = np.array([5]), np.array([True])
    assert s.trim(proposed, active).tolist() == [5]  # negative control: no confidence
    confidence = np.array([[0.95, 0.9, 0.02, 0.9, 0.9]])
    assert s.trim(proposed, active, confidence=confidence).tolist() == [2]
    unsure = np.array([[0.05, 0.9, 0.9, 0.9, 0.9]])
    assert s.trim(proposed, active, confidence=unsure).tolist() == [0]  # a plain step
    # NaN: no confidence for that token, the row's acceptance prices it
    assert s.trim(proposed, active, confidence=np.full((1, 5), np.nan)).tolist() == [5]


def test_calibration_learns_how_often_confident_tokens_pass():
    s = schedule(FLAT)
    assert s.calibrated(np.array([0.9, 0.3]))[0] == pytest.approx(0.9)  # the prior: taken at its word
    over = np.array([[0.9, 0.9]])
    for _ in range(20):  # tokens it is 90% sure of fail
        s.record_outcome(np.array([2]), np.array([0]), confidence=over)
    assert s.calibrated(np.array([0.9]))[0] < 0.2
    assert s.calibrated(np.array([0.3]))[0] == pytest.approx(0.3)  # other bins keep the prior
    under = np.array([[0.3, 0.3]])
    for _ in range(20):  # tokens it is 30% sure of pass (both: the second is tested too)
        s.record_outcome(np.array([2]), np.array([2]), confidence=under)
    assert s.calibrated(np.array([0.3]))[0] > 0.8
    assert np.isnan(s.calibrated(np.array([np.nan]))[0])


def test_only_tested_positions_are_calibrated():
    s = schedule(FLAT)
    # position 0 fails, so position 1 (confidence 0.1) is never tested: its bin learns nothing
    for _ in range(10):
        s.record_outcome(np.array([2]), np.array([0]), confidence=np.array([[0.95, 0.15]]))
    assert s.calibrated(np.array([0.15]))[0] == pytest.approx(0.15)
    assert s.calibrated(np.array([0.95]))[0] < 0.3


def test_worth_drafting_stops_rows_the_drafter_is_unsure_of():
    s = schedule(FLAT, draft_ms=3.0, batch=2)
    for _ in range(6):
        s.record_outcome(np.array([4, 4]), np.array([3, 3]))
    sure, unsure = [0.95, 0.9], [0.2, 0.1]
    assert s.worth_drafting(np.array([sure, unsure])).tolist() == [True, False]
    # negative control: a drafter costing a whole forward per token is not worth another token
    dear = schedule(FLAT, draft_ms=60.0, batch=2)
    for _ in range(6):
        dear.record_outcome(np.array([4, 4]), np.array([3, 3]))
    assert dear.worth_drafting(np.array([sure, unsure])).tolist() == [False, False]


def test_a_confident_drafter_is_asked_for_its_full_cap_once_a_step_drafts():
    s = schedule(FLAT)
    for _ in range(2):
        s.record_outcome(np.array([1]), np.array([1]))
    caps, active = np.array([6]), np.array([True])
    narrow = int(s.plan(caps, active)[0])
    assert 0 < narrow < 6  # the evidence limit
    s.confident = True
    assert s.plan(caps, active).tolist() == [6]
    # ... but not when the step does not draft
    for _ in range(10):
        s.record_outcome(np.array([4]), np.array([0]))
    assert s.plan(caps, active).tolist() == [0]


# one token tested alone is cheap, two or three are dear, four and more cheap again (padded widths)
UNEVEN = {1: 40.0, 2: 80.0, 3: 80.0, 4: 80.0, 5: 58.0, 6: 58.0, 7: 58.0, 8: 60.0}


def test_sampled_proposals_are_tested_sequentially():
    """With drawn tokens, whether token i is tested may depend on the tokens before it, not on whether
    the drafter went on past it: the count is ``min(proposed, w)``, ``w`` chosen from what was asked."""
    s = schedule(UNEVEN)
    for _ in range(6):
        s.record_outcome(np.array([4]), np.array([2]))
    one = np.array([True])

    def chosen(p, **kw):
        return int(s.trim(np.array([p]), one, **kw)[0])

    # negative control: greedy, the rule prices what came back, so the first token is tested only
    # when a second one follows it (harmless there: greedy output does not depend on what is tested)
    assert chosen(1) == 0 and chosen(2) == 2
    for asked in (1, 2, 6):
        w = chosen(asked, asked=np.array([asked]))
        got = [chosen(p, asked=np.array([asked])) for p in range(asked + 1)]
        assert got == [min(p, w) for p in range(asked + 1)], asked
    assert chosen(1, asked=np.array([6])) == 1
    # a drafter that reported its confidence stopped each row token by token: all it proposed is tested
    conf = [chosen(p, asked=np.array([6]), confidence=np.full((1, p), 0.3)) for p in range(1, 7)]
    assert conf == list(range(1, 7))


def test_sampled_free_rows_are_chosen_from_their_proposals():
    """A hybrid batch at T > 0: the lookup row's count comes from what it proposed; the drawn row's
    from what it was asked, whatever it returned."""
    s = schedule(UNEVEN, batch=2)
    for _ in range(6):
        s.record_outcome(np.array([4, 4]), np.array([2, 2]))
    both, free = np.array([True, True]), np.array([True, False])
    rows = [s.trim(np.array([3, p]), both, free, asked=np.array([0, 6])).tolist() for p in range(7)]
    w = rows[-1][1]
    assert w > 0 and [r[1] for r in rows] == [min(p, w) for p in range(7)]
    assert len({r[0] for r in rows}) == 1 and rows[0][0] > 0  # the lookup's tested count: its own


def test_a_drafters_catch_up_after_plain_steps_is_not_its_cost_per_token():
    """A proposal after plain steps includes the drafter's catch-up on the tokens they committed: its time is
    left out of the cost per token; after a drafting step the same time counts (negative control)."""
    s = schedule(CPU_LIKE, draft_ms=3.0)
    assert s._draft_cost() == pytest.approx(0.003)
    s.record_outcome(np.array([0]), np.array([0]))  # a plain step
    for _ in range(4):
        s.record_draft(1, 0.050)
    assert s._draft_cost() == pytest.approx(0.003)
    s.record_outcome(np.array([1]), np.array([1]))  # a drafting step
    for _ in range(4):
        s.record_draft(1, 0.050)
    assert s._draft_cost() == pytest.approx(0.050)
