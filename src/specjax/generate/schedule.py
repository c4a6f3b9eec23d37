"""The cost-aware draft length: how many tokens to draft and verify, per step and per row.

:class:`DraftSchedule` is asked by the loop before each step and told after
it. Its contract:

* **Choice.** Each step it picks the width ``w`` (the batch's largest ``k``;
  row b drafts ``k_b = min(w, what the row may and can draft)``) that
  shortens the call most per second. A row whose draft tokens pass with
  probability ``α`` each gains ``E(α, k) = (1 − α^(k+1)) / (1 − α)`` tokens
  (Leviathan et al. 2023, eq. 1); a call ends when its last row does, so a
  step is worth what drafting so at every step would take off the steps of
  the call's last row, per step (:func:`expected_call_gain`: ``R / E[max_b N_b]``,
  ``r_b`` the tokens row b still needs, ``N_b`` the steps it would take), over its cost:
  the drafter's time for the tokens, one target forward over ``w + 1`` tokens
  and the rest of the step. ``w = 0`` is a plain decoding step (worth 1), so a
  drafter that does not pay is not used; a paid draft (a model) must beat a
  plain step by ``PAID_MARGIN``.
* **Costs** are measured, never assumed, and kept per model, batch size and
  packing setting for later calls: the target forward over ``q`` tokens (the
  median of its recent times, the first at a new shape ignored; an unmeasured
  ``q`` priced by the line through the measured widths around it, or a prior
  scaled from the nearest one), the drafter's time per token, and the rest
  of a step, apart for drafting and plain steps. A width not yet timed is run
  once, padded with a filler token that is never tested, on a step that
  drafts anyway (the decision is priced at the width the step needs:
  :meth:`DraftSchedule.priced_width`); a width measured dearer than a wider one
  is padded up to it.
* **Acceptance** ``α`` per row: decaying counts of passed and failed tests
  over a fixed prior, apart for a drafter's own proposals and the free
  lookups it mixes in (``Proposal.free_rows``), plus the tests of the tokens a
  drafter scores in hindsight (``Proposal.hindsight``); the tests of earlier
  calls with the same target and drafter (greedy or sampled, as this call)
  are carried in at a bounded weight. A paid draft is at most one token wider
  than the tests behind its estimate. When every row is greedy and the
  drafter reports ``Proposal.confidence``, each position is priced by that
  confidence calibrated per bin against the tests
  (:meth:`DraftSchedule.calibrated`), and :meth:`DraftSchedule.worth_drafting`
  stops a row once one more token does not pay.
* **Exploration.** After ``EXPLORE_EVERY`` steps without drafting a step
  verifies one token anyway (the interval doubles while that does not lead
  to drafting); until a plain step has been timed, every
  ``EXPLORE_PLAIN_AFTER``-th drafting step is a plain one, and a plain time
  ``PLAIN_REFRESH`` steps old is refreshed when drafting wins by less than
  ``CLOSE_CALL``.

The choice depends only on past steps, never on the current step's random
draws, so the output distribution is unchanged whatever the schedule picks.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import numpy as np

__all__ = ["DraftSchedule", "call_gains", "expected_call_gain"]

_PRIOR_PASS, _PRIOR_FAIL = 1.2, 0.8  # α = 0.6 before any test
_DECAY = 0.85  # per step, for the pass/fail counts
_KEEP = 6  # recent times kept per cost
EXPLORE_EVERY = 12  # steps without drafting before one exploring step
EXPLORE_BACKOFF = 2  # ... doubled after each fruitless one, at most this many times
EXPLORE_PLAIN_AFTER = 4  # drafting steps before a plain one, while plain steps have no time
PLAIN_REFRESH = 32  # steps since a plain step was timed, after which a close call times one again
CLOSE_CALL = 1.25  # ... close: drafting's expected rate is below this many times a plain step's
PAID_MARGIN = 1.05  # a paid draft must promise this much more than a plain step
_FORGET = 0.99  # per step without drafting, for the pass/fail counts


class _PerModel:
    """``{model: {key: value}}`` by the model's identity, holding it weakly: a model's entries go
    when the model is freed (a long-lived process loads and drops models)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], dict[Any, Any]]] = {}

    def of(self, model: Any) -> dict[Any, Any]:
        """The table of ``model`` (made empty on first use)."""
        key = id(model)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not model:
            entries = self._entries

            def drop(ref: weakref.ref[Any]) -> None:  # the model is being freed
                if entries.get(key, (None,))[0] is ref:
                    del entries[key]

            entry = (weakref.ref(model, drop), {})
            entries[key] = entry
        return entry[1]

    def __len__(self) -> int:
        return len(self._entries)


# Timings shared between calls: model -> {(batch, packed layers): timings}; the forwards'
# costs differ with the layers' packing (specjax.packed), so each setting has its own.
_SHARED = _PerModel()
_CARRY_WEIGHT = 4.0  # at most this many tests' weight carried into a new call's rows
_CARRY_DECAY = 0.5  # per call, for the carried tallies
# Acceptance tallies carried between calls: model -> {(drafter, greedy): (f64[2 kinds, 2], ...)},
# [kind, 0] tokens that passed, [kind, 1] tests that failed; and the drafter's calibration
# (Proposal.confidence), f64[2, _CAL_BINS]: [0] tests that passed, [1] that failed, per bin.
_CARRIED = _PerModel()
_CAL_BINS = 10  # equal bins of the drafter's confidence in [0, 1]
_CAL_PRIOR = 2.0  # tests' weight of the prior that a token passes with the drafter's confidence
_CAL_DECAY = 0.98  # per step that tests confident proposals, for the bins' counts


def expected_call_gain(probs: np.ndarray, k: np.ndarray, remaining: np.ndarray | None) -> float:
    """The tokens a step at these draft lengths is worth to the call: how much faster, per step, the call's last row
    ends than with plain steps, if every step drafted so.

    ``probs``: f64[B, g], the chance that each draft token passes given that
    the ones before it did; ``k``: i64[B] in [0, g], the tokens each row
    tests; ``remaining``: f64[B], the tokens each row still needs (None, or
    all zero: rows alike, :data:`NOMINAL_REMAINING` each). Row b gains
    ``X_b ∈ [1, k_b + 1]`` tokens a step, ``P(X_b ≥ j + 1) = Π_{i≤j} p_{b,i}``,
    independently of the other rows and of its other steps.

    At B = 1 this is ``E[X] = 1 + Σ_{i<k} Π_{j≤i} p_j`` (Leviathan et al. 2023,
    eq. 1, with a probability per position): a step's expected gain is the
    row's rate. In a batch the call ends when its last row does: plain steps
    take ``R = max_b r_b`` of them; drafting so at every step, row b needs
    ``N_b`` steps, about normal with mean ``r_b / μ_b + E[X_b(X_b − 1)] / 2μ_b²``
    and variance ``r_b σ_b² / μ_b³`` (renewal theory; ``μ_b``, ``σ_b²`` the mean and
    variance of ``X_b``), and the call ``E[max_b N_b]`` (integrated over the
    rows' normal laws). The worth is ``R / E[max_b N_b]``, in [1, max_b k_b + 1].

    Not the step's own ``E[R − max_b (r_b − X_b)]``: that one-step view prices
    eight rows that pass each token with probability 0.5 at 1.004 tokens for
    a one-token draft (all eight must pass to shorten the call this step), so
    a batch whose rows are level never drafts and stays level; drafting at
    every step, the rows spread and the lagging ones gain in turn: 64 tokens
    take 46 steps (1.39 a step), where each row expects 1.5
    (``tests/test_schedule.py`` checks both against simulated calls).
    """
    probs = np.asarray(probs, np.float64)
    k = np.asarray(k, np.int64)
    n = probs.shape[0]
    if n == 0:
        return 1.0
    if n == 1:  # 1 + Σ_{i<k} Π_{j≤i} p_j, in Python floats (a step asks this for every width)
        gain = reach = 1.0
        for p in probs[0, : int(k[0])].tolist():
            reach *= p
            gain += reach
        return gain
    return float(call_gains(probs, k[None, :], remaining)[0])


def call_gains(probs: Any, ks: Any, remaining: Any | None, xp: Any = np) -> Any:
    """f[W]: :func:`expected_call_gain` of a batch of B >= 2 rows at each of W sets of draft lengths
    ``ks`` (i[W, B]), in one pass. ``xp``: numpy (float64, the host's schedule) or jax.numpy (float32, traced
    into the device-resident loop's step: :func:`specjax.generate.jax_loop.drafts_next`)."""
    f = np.float64 if xp is np else np.float32
    probs = xp.asarray(probs, f)
    ks = xp.asarray(ks)
    n, g = probs.shape
    # surv[w, b, j] = P(X_b ≥ j + 1), j = 0 .. g: 1, then the running product while j ≤ k_b, then 0
    surv = xp.concatenate([xp.ones((n, 1), f), xp.cumprod(probs, axis=1)], axis=1)
    surv = xp.where(xp.arange(g + 1)[None, None, :] <= ks[:, :, None], surv[None], f(0))
    mean = surv.sum(axis=2)  # μ_b = Σ_j P(X_b ≥ j + 1)
    second = (surv * (2 * xp.arange(g + 1, dtype=f) + 1)).sum(axis=2)  # E[X_b²] = Σ_j (2j + 1) P(X_b ≥ j + 1)
    var = xp.maximum(second - mean**2, f(0))
    r = xp.zeros(n, f) if remaining is None else xp.maximum(xp.asarray(remaining, f), f(0))
    r = xp.where(xp.any(r > 0), r, f(NOMINAL_REMAINING))  # no counts given: rows alike
    total = r.max()
    # [W, B]: the renewal count's mean with its end correction E[X(X − 1)] / 2μ² (a row stops at its last token;
    # tests/test_schedule.py holds the gain within 3 % of simulated calls down to 6 tokens left), at most r_b steps
    steps_mean = xp.minimum(r / mean + (second - mean) / (2 * mean**2), r)
    steps_sd = xp.sqrt(r * var / mean**3)
    # E[max_b N_b] = ∫_0^R P(max_b N_b > t) dt (N_b <= r_b <= R: a row gains a token a step at least)
    t = (xp.arange(_GRID, dtype=f) + f(0.5)) * (total / _GRID)
    z = (t - steps_mean[..., None]) / xp.maximum(steps_sd, f(1e-9))[..., None]
    below = xp.where(steps_sd[..., None] > 0, _normal_cdf(z, xp), t >= steps_mean[..., None])
    last = (1 - xp.prod(below, axis=1)).sum(axis=1) * (total / _GRID)
    return xp.clip(total / xp.maximum(last, f(1e-9)), 1, ks.max(axis=1, initial=0) + 1)


NOMINAL_REMAINING = 64  # tokens each row needs, for a batch whose remaining counts are not given
_GRID = 128  # points of the integral over the call's steps


def _normal_cdf(z: Any, xp: Any = np) -> Any:
    """Φ(z), vectorised (Abramowitz and Stegun 7.1.26 for erf: absolute error below 1.5e-7)."""
    x = xp.abs(z) / np.sqrt(2.0)
    t = 1 / (1 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1 - poly * xp.exp(-x * x)
    return 0.5 * (1 + xp.sign(z) * erf)


class _Times(dict[Any, deque[float]]):
    """key -> the recent times (seconds) of one kind of work, with each key's estimate kept until
    the key's next time (a step asks for estimates dozens of times and records a few)."""

    def __init__(self) -> None:
        super().__init__()
        self._estimates: dict[Any, float | None] = {}
        self.verify_widths: list[int] = []  # the widths with a ("verify", w) entry, ascending

    def record(self, key: Any, seconds: float) -> None:
        if key not in self:
            self[key] = deque(maxlen=_KEEP + 1)
            if key[0] == "verify":
                self.verify_widths = sorted([*self.verify_widths, key[1]])
        self[key].append(seconds)
        self._estimates.pop(key, None)

    def estimate(self, key: Any) -> float | None:
        """The median of the recent times of ``key``, ignoring its very first (warm-up) time; None if unknown.

        The median rather than the smallest: a step's cost is what it takes on
        average, and the smallest of several noisy times is biased low (more
        for the wider, noisier forwards of drafting steps).
        """
        if key in self._estimates:
            return self._estimates[key]
        t = self.get(key)
        if t is None or len(t) < 2:
            est = None
        else:
            kept = sorted(list(t)[1:] if len(t) <= _KEEP else t)  # a handful: faster than np.median
            mid = len(kept) // 2
            est = kept[mid] if len(kept) % 2 else 0.5 * (kept[mid - 1] + kept[mid])
        self._estimates[key] = est
        return est


class DraftSchedule:
    """Per-step choice of the draft width, from measured costs and per-row acceptance.

    Args:
      batch: B, the rows of the call.
      max_draft: G, the most tokens a row drafts per step.
      adaptive: False drafts ``min(G, what the row may)`` every step (the
        fixed schedule of classic speculative decoding).
      draft_cost_hint: seconds per drafted token assumed until measured.
      model: the target (timings are shared between calls on the same model
        and batch size, and acceptance between calls on the same model,
        drafter and ``greedy``).
      drafter_key: the drafter's name (keys its cost and its carried acceptance).
      greedy: every row greedy (acceptance differs between greedy and sampled
        calls, so each carries its own).
    """

    def __init__(
        self,
        batch: int,
        max_draft: int,
        *,
        adaptive: bool,
        draft_cost_hint: float,
        model: Any = None,
        drafter_key: str = "",
        greedy: bool = False,
    ) -> None:
        self.max_draft = max_draft
        self.adaptive = adaptive
        # [:, 0] the drafter's own proposals, [:, 1] free lookups mixed in (Proposal.free_rows)
        self.passes = np.zeros((batch, 2))
        self.fails = np.zeros((batch, 2))
        self.draft_cost_hint = float(draft_cost_hint)
        self.drafter_key = drafter_key
        self.idle_steps = 0  # steps since the last one that verified a proposal
        self.busy_steps = 0  # steps since the last one that did not
        self.explored = 0  # exploring steps since the last step that drafted on the estimates
        self._forced = False  # this step explores
        self.since_plain = 0  # steps since a plain step was timed
        self._edge = np.inf  # the last decision's rate over a plain step's (when it drafted)
        self._model = weakref.ref(model) if model is not None else None
        self._own: dict[int, _Times] = {}  # without a model: this call's, per batch size
        self.times = self._table(batch)
        self.tally, self.calibration = self._carried(greedy)
        self.confident = False  # the drafter has proposed with its confidence (set by the loop)
        # a new call's rows start from what earlier calls measured, as if seen a few tests ago
        tests = self.tally.sum(axis=1)
        scale = np.where(tests > 0, np.minimum(tests, _CARRY_WEIGHT) / np.maximum(tests, 1e-9), 0.0)
        self.passes += self.tally[:, 0] * scale
        self.fails += self.tally[:, 1] * scale

    def _carried(self, greedy: bool) -> tuple[np.ndarray, np.ndarray]:
        """f64[2, 2] and f64[2, _CAL_BINS]: the acceptance tallies and the calibration counts of
        earlier calls (decayed once more), updated in place by this one."""
        model = self._model() if self._model is not None else None
        if model is None:
            return np.zeros((2, 2)), np.zeros((2, _CAL_BINS))
        carried = _CARRIED.of(model)
        key = (self.drafter_key, bool(greedy))
        if key not in carried:
            carried[key] = (np.zeros((2, 2)), np.zeros((2, _CAL_BINS)))
        tally, calibration = carried[key]
        tally *= _CARRY_DECAY
        calibration *= _CARRY_DECAY
        return tally, calibration

    def _table(self, batch: int) -> _Times:
        """The timings of the model at ``batch`` rows (shared between calls)."""
        model = self._model() if self._model is not None else None
        if model is None:
            return self._own.setdefault(batch, _Times())
        from specjax.packed import packed_layers

        times: _Times = _SHARED.of(model).setdefault((batch, packed_layers(model)[0]), _Times())
        return times

    # ------------------------------------------------------------------ #
    # Costs
    # ------------------------------------------------------------------ #
    def _record(self, key: Any, seconds: float) -> None:
        self.times.record(key, seconds)

    def _estimate(self, key: Any) -> float | None:
        return self.times.estimate(key)

    def record_verify(self, q: int, seconds: float) -> None:
        self._record(("verify", q), seconds)
        if q == 1:
            self.since_plain = 0

    def record_draft(self, tokens: int, seconds: float) -> None:
        """A proposal of ``tokens`` per row that took ``seconds``: the drafter's cost per token.

        Not after plain steps: the drafter then first catches up on the tokens they committed (a draft
        model feeds them, the EAGLE head reads their hidden states), once, a cost that drafting at
        every step does not pay. Counted per token, it priced the EAGLE head at B = 8, after an
        exploring step that followed 12-48 plain ones, many times its cost drafting at every step, so
        the batch never drafted again.
        """
        if tokens > 0 and self.idle_steps == 0:
            self._record(("draft", self.drafter_key), seconds / tokens)

    def record_overhead(self, seconds: float, drafted: bool = True) -> None:
        """A step's time besides drafting and the target forward; ``drafted``: it verified draft tokens."""
        self._record(("overhead", bool(drafted)), seconds)

    def _verify_cost(self, q: int) -> float:
        t = self._estimate(("verify", q))
        if t is not None:
            return t
        # a prior: between two measured widths, the straight line between their costs; outside
        # them, small q cost little more than one token, scaled from the nearest measured width
        below = above = None
        for w in self.times.verify_widths:
            t = self._estimate(("verify", w))
            if t is None:
                continue
            if w < q:
                below = (w, t)
            elif above is None:
                above = (w, t)
        if below is not None and above is not None:
            (w0, t0), (w1, t1) = below, above
            return t0 + (t1 - t0) * (q - w0) / (w1 - w0)
        w, t = above or below or (1, 1.0)
        return t * (1 + 0.12 * (q - 1)) / (1 + 0.12 * (w - 1))

    def _draft_cost(self) -> float:
        t = self._estimate(("draft", self.drafter_key))
        return self.draft_cost_hint if t is None else t

    def _overhead(self, drafted: bool) -> float:
        """A step's measured time besides drafting and the forward (the other kind's until measured)."""
        t = self._estimate(("overhead", drafted))
        if t is None:
            t = self._estimate(("overhead", not drafted))
        return t or 0.0

    def _plain_rate(self) -> float:
        """Tokens per second of a plain decoding step (one token, no draft)."""
        return 1.0 / (self._verify_cost(1) + self._overhead(False))

    def padded_width(self, q: int) -> int:
        """The width to run for ``q`` needed tokens (see the module doc): the first width from ``q`` up
        that has no time yet (to learn it), else :meth:`priced_width`."""
        if not self.adaptive or q <= 1:
            return q
        for wider in range(q, self.max_draft + 3):
            if self._estimate(("verify", wider)) is None:
                return wider  # learn the widths from q up, once per model and batch size
        return self.priced_width(q)

    def priced_width(self, q: int) -> int:
        """The width whose cost prices a step that needs ``q`` tokens: ``q``, or a width at most two
        wider measured (or, unmeasured, estimated) to be cheaper.

        Not :meth:`padded_width`: a width run only to learn its time is a one-time cost, paid on a
        step that drafts anyway. Priced into the decision, it made every draft of a call cost as
        the widest width not yet timed (on the default pair, a 1-token draft priced as a forward
        over 8 tokens, 119 ms against 54 ms for a plain step), so the schedule stopped drafting,
        never timed that width, and decoded plainly until an exploring step: a process's first
        call drafted in 24-46 % of its steps, 72-78 % once priced here.
        """
        if not self.adaptive or q <= 1:
            return q
        limit = self.max_draft + 2
        best, cost = q, self._verify_cost(q)
        for wider in range(q + 1, min(q + 2, limit) + 1):  # farther, noise would pick widths measured low by chance
            t = self._verify_cost(wider)
            if t < 0.97 * cost:
                best, cost = wider, t
        return best

    # ------------------------------------------------------------------ #
    # Decisions
    # ------------------------------------------------------------------ #
    def alpha(self, free_rows: np.ndarray | None = None) -> np.ndarray:
        """f64[B']: each row's acceptance estimate for its own kind of proposal.

        ``free_rows``: bool[B'], rows whose proposal is a free lookup mixed in by
        the drafter (their estimate is kept apart); None: the drafter's own.
        """
        both = (self.passes + _PRIOR_PASS) / (self.passes + self.fails + _PRIOR_PASS + _PRIOR_FAIL)
        return both[:, 0] if free_rows is None else np.where(free_rows, both[:, 1], both[:, 0])

    @staticmethod
    def _bins(confidence: np.ndarray) -> np.ndarray:
        """i64[...]: the calibration bin of each confidence (NaN counts as 0; callers mask it)."""
        c = np.where(np.isfinite(confidence), confidence, 0.0)
        return np.clip((c * _CAL_BINS).astype(np.int64), 0, _CAL_BINS - 1)

    def calibrated(self, confidence: np.ndarray) -> np.ndarray:
        """f64[...]: the chance that a draft token passes, from the drafter's confidence in it.

        ``confidence``: f64[...] in [0, 1] (:attr:`specjax.drafters.Proposal.confidence`;
        NaN stays NaN). Per bin of confidence, the pass rate of the tests seen so far
        (decayed; carried between calls like the acceptance), starting from a
        prior of ``_CAL_PRIOR`` tests that pass at the confidence's own value.
        """
        c = np.asarray(confidence, np.float64)
        known = np.isfinite(c)
        c0 = np.where(known, c, 0.0)
        bins = self._bins(c)
        passed, failed = self.calibration[0][bins], self.calibration[1][bins]
        rate = (passed + _CAL_PRIOR * c0) / (passed + failed + _CAL_PRIOR)
        return np.where(known, rate, np.nan)

    def _probs(self, width: int, free_rows: np.ndarray | None, confidence: np.ndarray | None) -> np.ndarray:
        """f64[B', width]: each draft position's chance to pass, given the ones before it did:
        the calibrated confidence where the drafter gave one, else the row's acceptance."""
        alpha = self.alpha(free_rows)
        probs = np.broadcast_to(alpha[:, None], (len(alpha), width))
        if confidence is None or width == 0:
            return probs
        conf = np.full((len(alpha), width), np.nan)
        given = np.asarray(confidence, np.float64)[:, :width]
        conf[:, : given.shape[1]] = given
        cal = self.calibrated(conf)
        return np.where(np.isfinite(cal), cal, probs)

    def _best_width(
        self,
        limits: np.ndarray,
        rows: np.ndarray,
        draft_s_per_token: float,
        free_rows: np.ndarray | None = None,
        remaining: np.ndarray | None = None,
        confidence: np.ndarray | None = None,
    ) -> int:
        """argmax over w of what the step shortens the call by, per second (see :meth:`plan`).

        The call ends when its last row does: a step at width ``w`` is worth
        :func:`expected_call_gain` tokens of the call's largest remaining count
        ``R = max_b r_b`` (each row testing ``min(w, limit_b)`` tokens, each
        position's chance to pass the row's acceptance ``α_b`` or the
        calibrated confidence of the drafter in the token), and costs
        ``w·draft cost + verify(w + 1) + overhead``; a plain step is worth 1.
        At B = 1 this is ``E(α, k)`` tokens per step's cost; in a batch,
        drafting pays only where it advances the rows that lag, all of them
        (a row far ahead of the others gains nothing for the call: the slowest
        row still needs its steps, at the batch's width).

        ``rows``: bool[B'], the rows that decode this step, whether they may
        draft or not (a row with ``limit_b = 0`` gains its one token either
        way, and the forward's width is paid for it too); ``remaining``:
        i64[B'], the tokens each row may still generate (None: all alike);
        ``confidence``: f64[B', g] or None (:attr:`Proposal.confidence`).
        """
        lim = limits[rows]
        top = int(lim.max(initial=0))
        if top == 0:
            return 0
        probs = self._probs(top, free_rows, confidence)[rows]
        left = np.zeros(len(lim)) if remaining is None else np.asarray(remaining, np.float64)[rows]
        overhead = self._overhead(True)
        margin = PAID_MARGIN if draft_s_per_token > 0 else 1.0001
        plain = self._plain_rate()
        best_w, best_rate = 0, margin * plain
        widths = np.arange(1, top + 1)
        if len(lim) > 1:  # every width at once (the one-row gain is a short loop of its own)
            gains = call_gains(probs, np.minimum(widths[:, None], lim[None, :]), left).tolist()
        else:
            gains = [expected_call_gain(probs, np.minimum(w, lim), left) for w in widths.tolist()]
        for w, gain in zip(widths.tolist(), gains, strict=True):
            cost = w * draft_s_per_token + self._verify_cost(self.priced_width(w + 1)) + overhead
            rate = gain / cost
            if rate > best_rate:
                best_w, best_rate = w, rate * 1.0001
        self._edge = best_rate / plain if best_w else np.inf
        return best_w

    def plan(self, caps: np.ndarray, active: np.ndarray, remaining: np.ndarray | None = None) -> np.ndarray:
        """i64[B']: how many tokens to ask the drafter for, per row (before it proposes).

        ``caps``: i64[B'], the most each row may draft; ``active``: bool[B'];
        ``remaining``: i64[B'], tokens each row may still generate (None: all
        alike), for the call's objective: the time until its last row ends.

        A row drafts at most one token more than it has tests of the drafter
        behind it (decayed counts, hindsight included): while its acceptance is
        mostly the prior, a wide draft that fails costs a wide forward for
        nothing. A drafter that reports its confidence in each token
        (:attr:`confident`) is asked for up to ``caps`` once a step drafts at
        all: it stops a row where :meth:`worth_drafting` says so, and
        :meth:`trim` verifies what its calibrated confidence says pays.
        """
        if not self.adaptive:
            return caps
        evidence = np.floor(self.passes[:, 0] + self.fails[:, 0]).astype(np.int64)
        limits = np.minimum(caps, 1 + evidence)
        w = self._explore(self._best_width(limits, active, self._draft_cost(), None, remaining))
        if self.confident and w > 0 and not self._forced:
            return np.where(limits > 0, caps, 0)
        return np.minimum(limits, w)

    def worth_drafting(self, confidence: np.ndarray) -> np.ndarray:
        """bool[B']: rows for which drafting one more token is expected to pay.

        ``confidence``: f64[B', i], the drafter's confidence in the ``i`` tokens
        it drafted so far this step (NaN: none given). The next token adds
        ``Π_{j≤i} p_j · α_b`` tokens on average (``p_j`` calibrated, ``α_b`` the
        row's acceptance for the token it has not seen) for the drafter's time
        per token and the wider forward (``verify(i + 2) − verify(i + 1)``,
        padded widths), and pays when that beats the rate of plain decoding.
        """
        c = np.asarray(confidence, np.float64)
        i = c.shape[1]
        alpha = self.alpha()
        reach = np.prod(self._probs(i, None, c), axis=1)
        wider = self._verify_cost(self.priced_width(i + 2)) - self._verify_cost(self.priced_width(i + 1))
        extra = self._draft_cost() + max(0.0, wider)
        return bool(self.adaptive) & (reach * alpha >= extra * self._plain_rate())

    def _explore(self, w: int) -> int:
        """The chosen width, or an exploring step's (see the module doc)."""
        if w == 0 and self.idle_steps >= EXPLORE_EVERY << min(self.explored, EXPLORE_BACKOFF):
            self._forced = True
            return 1
        if w > 0 and self.busy_steps >= EXPLORE_PLAIN_AFTER:
            if self._estimate(("verify", 1)) is None:
                return 0
            if self.since_plain >= PLAIN_REFRESH and self._edge < CLOSE_CALL:
                return 0  # a close call on an old plain time: time it again
        return w

    def trim(
        self,
        proposed: np.ndarray,
        active: np.ndarray,
        free_rows: np.ndarray | None = None,
        remaining: np.ndarray | None = None,
        confidence: np.ndarray | None = None,
        asked: np.ndarray | None = None,
    ) -> np.ndarray:
        """i64[B']: how many of the proposed tokens to verify (the drafting is paid already).

        ``free_rows``: the proposal's rows that are free lookups (see :meth:`alpha`);
        ``remaining``: as in :meth:`plan`; ``confidence``: f64[B', g] or None, the
        drafter's confidence in each proposed token (:attr:`Proposal.confidence`):
        each position is then priced by its calibrated confidence
        (:meth:`calibrated`), so a step verifies the tokens the drafter is sure of
        and stops where it is not, rather than a width set by the row's average.

        ``asked``: None when every row is greedy (how many tokens are tested
        cannot change the output), else i64[B'], for sampled proposals (with
        logits), what each row could propose whatever it drew (what
        :meth:`plan` asked for; a drafter asked every step: its limit). There,
        whether a row's draft token
        ``i`` is tested may depend on the tokens before it but not on itself or
        later ones: a token tested only when the ones after it look likely (or
        when the drafter went on past it) passes more often than its draft
        probability says, and the output is biased. So a drawn row's count is
        chosen sequentially: ``min(proposed, w)`` with ``w`` from what was
        asked, not from what came back; or, where the drafter reported its
        confidence, everything it proposed (it stopped each row token by token
        where :meth:`worth_drafting` said, which depends only on the tokens
        already drawn). Free rows (lookups: point masses fixed by the context)
        are chosen from what they proposed, as in greedy calls.
        """
        if not self.adaptive:
            return proposed
        if asked is None:
            w = self._explore(self._best_width(proposed, active, 0.0, free_rows, remaining, confidence))
            return np.minimum(proposed, w)
        free = np.zeros(len(proposed), bool) if free_rows is None else np.asarray(free_rows, bool)
        w = self._explore(self._best_width(np.where(free, proposed, asked), active, 0.0, free_rows, remaining))
        drawn = proposed if confidence is not None and w > 0 else np.minimum(proposed, w)
        return np.where(free, np.minimum(proposed, w), drawn)

    # ------------------------------------------------------------------ #
    # Learning
    # ------------------------------------------------------------------ #
    def record_outcome(
        self,
        tested: np.ndarray,
        accepted: np.ndarray,
        free_rows: np.ndarray | None = None,
        confidence: np.ndarray | None = None,
    ) -> None:
        """Per row: ``tested`` = k_b, ``accepted`` = n_b (a failed test when n_b < k_b).

        ``free_rows``: the rows whose proposal was a free lookup (see :meth:`alpha`);
        ``confidence``: f64[B', g] or None, the drafter's confidence in each
        proposed token: the tested ones (``i <= n_b``, ``i < k_b``) count in the
        calibration (:meth:`calibrated`).
        """
        drafted = tested > 0
        if confidence is not None and drafted.any():
            self._calibrate(np.asarray(confidence, np.float64), tested, accepted)
        self.idle_steps = 0 if drafted.any() else self.idle_steps + 1
        if self._forced:
            self.explored += 1
        elif drafted.any():  # drafted on the estimates
            self.explored = 0
        self._forced = False
        self.busy_steps = self.busy_steps + 1 if drafted.any() else 0
        self.since_plain += 1
        kind = np.zeros(len(tested), np.int64) if free_rows is None else np.asarray(free_rows, np.int64)
        # the counts of the row's kind of proposal learn, the other kind's forget
        learned = drafted[:, None] & (np.arange(2)[None, :] == kind[:, None])
        passes, fails = accepted[:, None], (accepted < tested)[:, None]
        self.tally[:, 0] += np.where(learned, passes, 0).sum(axis=0)
        self.tally[:, 1] += np.where(learned, fails, 0).sum(axis=0)
        self.passes = np.where(learned, _DECAY * self.passes + passes, self.passes * _FORGET)
        self.fails = np.where(learned, _DECAY * self.fails + fails, self.fails * _FORGET)

    def _calibrate(self, confidence: np.ndarray, tested: np.ndarray, accepted: np.ndarray) -> None:
        """Count the tested positions' outcomes in the bins of their confidence."""
        g = confidence.shape[1]
        pos = np.arange(g)[None, :]
        seen = (pos < np.minimum(accepted + 1, tested)[:, None]) & np.isfinite(confidence)
        if not seen.any():
            return
        bins = self._bins(confidence)
        passed = seen & (pos < accepted[:, None])
        self.calibration *= _CAL_DECAY
        self.calibration[0] += np.bincount(bins[passed], minlength=_CAL_BINS)
        self.calibration[1] += np.bincount(bins[seen & ~passed], minlength=_CAL_BINS)

    def record_hindsight(self, hits: np.ndarray, tests: np.ndarray) -> None:
        """Per row: ``tests`` after-the-fact tests of the drafter's own kind, ``hits`` of them passed.

        (:attr:`specjax.drafters.Proposal.hindsight`: what the drafter would have
        proposed where the target committed tokens without testing it.)
        """
        self.passes[:, 0] += hits
        self.fails[:, 0] += tests - hits
        if np.sum(tests) > 0:
            # fresh tests: the step need not verify a token to look (see the module doc)
            self.idle_steps = 0
        self.tally[0] += (np.sum(hits), np.sum(tests) - np.sum(hits))

    def select_rows(self, rows: list[int]) -> None:
        """Keep ``rows``; costs are then those measured at the new batch size (forwards cost less)."""
        self.passes, self.fails = self.passes[rows], self.fails[rows]
        self.times = self._table(len(rows))
