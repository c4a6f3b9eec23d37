"""Logits processors inside the speculative loop, exact (``speculative_generate(..., logits_processor=...)``).

The rule that keeps speculation exact with a processor (Leviathan et al. 2023,
arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318): at draft position ``j``
of row ``b`` the target's logits, and a model drafter's when it draws ``x_j``,
are processed with the prefix that position sees, the row's prompt (left-padded
as given) followed by its committed tokens and the draft tokens ``x_0 ..
x_{j-1}``, exactly as transformers' ``generate`` processes them once it has
produced that prefix. Both distributions of the acceptance test are then the
processed ones; the processed target logits go through the acceptance step
unchanged (temperature, top-k, top-p after the processors, transformers' order).
Point-mass drafters (n-gram lookups) are processed on the target's side only.

The hook (how a processor is called; item 3's grammar matchers plug in here)
---------------------------------------------------------------------------

A processor is one of two kinds; a chain mixes them and applies them in order.

* **A transformers-style callable** ``(input_ids i64[B, L], scores f32[B, V]) ->
  f32[B, V]`` (any ``LogitsProcessor``, a ``LogitsProcessorList``'s items, a
  plain function). ``input_ids`` is what ``generate`` would pass: the whole
  batch, B rows in the caller's row order (rows that finished or were dropped
  included), each the left-padded prompt (P columns) followed by that row's
  tokens. Rows of one step sit at different lengths (each accepts its own
  count), so it is called once per distinct prefix length ``L`` among the
  positions processed; rows at length ``L`` see their exact prefix, the other
  rows a stand-in (their own tokens cut or padded to ``L``, zero scores) whose
  output is discarded. Keeping the batch whole keeps row-indexed state right
  (``PrefixConstrainedLogitsProcessor``'s batch id,
  ``RepetitionPenaltyLogitsProcessor``'s per-row ``prompt_ignore_length``).
  Such a processor must be a function of its inputs (transformers' are, except
  :data:`REFUSED_PROCESSORS`, refused): it is called more often than in
  ``generate``, and on draft tokens that may be rejected. transformers' own
  built-in classes (the penalties, n-gram and word bans, the warpers, the
  length rules: exactly those :func:`specjax.generate.row_processors.vectorised`
  lists, whether built from options, prepared by ``generate`` or passed in a
  list) do not take this path: they run as row processors, vectorised.
* **A row processor**: an object with ``process_rows(prefixes, scores)``,
  ``prefixes`` a :class:`~specjax.generate.row_processors.Prefixes` (shared by
  the chain's row processors: read it, never write to it) and ``scores``
  f32[N, V] (the loop's own tensor: it may be written in place and returned),
  returning f32[N, V]; optionally ``start(batch, prompt_length)``,
  called once before a call's first step. Per step it is called once per draft
  position of a model drafter (``i = 0, 1, ..``, the rows that draft, each
  prefix = committed + ``x_0 .. x_{i-1}``), then once for the target with every
  processed position of every row, row-major (row b's positions ``0 .. k_b`` in
  order). ``prefixes.rows`` names each scores row's batch row, ``prefixes.committed`` how much of its prefix is
  committed (only grows from step to step); the rest are draft tokens that may
  be rejected. A grammar keeps one matcher per row: advance it along a call's
  draft tokens, fill the mask, and roll it back to the committed prefix (its
  tokens are the prefix's first ``committed`` ones) before the next call.

Cost: nothing when no processor is given (the loop takes its plain path). With
processors, one host copy of the draft tokens per draft position and per step,
a float32 copy of the processed logits, one :class:`Prefixes` per batch of
positions when a row processor runs, and the processors' own calls (counted in
``SpeculativeStats.processor_calls``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specjax.generate.checks import PluginOutputError
from specjax.generate.row_processors import Prefixes, vectorised

__all__ = [
    "PROCESSOR_OPTIONS",
    "REFUSED_PROCESSORS",
    "WARPER_OPTIONS",
    "LoopProcessors",
    "build_processors",
    "is_row_processor",
    "processor_name",
    "refusal",
    "split_prepared",
]

#: The options ``speculative_generate`` builds into transformers' processors (before temperature).
PROCESSOR_OPTIONS = (
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
)
#: The options transformers applies after temperature / top-k / top-p (sampling only).
WARPER_OPTIONS = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
#: transformers' processors the loop cannot run, by class name, and why: they keep state from call to call or run
#: a model of their own, where the loop calls a processor several times a step on prefixes that may be rejected.
REFUSED_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "runs the model on its own unconditional prompt, a token a call",
    "ClassifierFreeGuidanceLogitsProcessor": "needs a conditional and an unconditional row per row",
    "SynthIDTextWatermarkLogitsProcessor": "keeps state from call to call",
    "WhisperTimeStampLogitsProcessor": "is Whisper's (encoder-decoder)",
    "WhisperNoSpeechDetection": "is Whisper's (encoder-decoder)",
    # other libraries' processors, by module and class name
    "xgrammar.contrib.hf.LogitsProcessor": "keeps its grammar matchers' state from call to call (pass json_schema= "
    "or regex= instead)",
}


def refusal(p: Any) -> str | None:
    """Why the loop refuses processor ``p`` (:data:`REFUSED_PROCESSORS`, by class name or module and class name)."""
    kind = type(p)
    return REFUSED_PROCESSORS.get(kind.__name__) or REFUSED_PROCESSORS.get(f"{kind.__module__}.{kind.__qualname__}")


def is_row_processor(p: Any) -> bool:
    """Whether ``p`` takes the row-processor hook (a ``process_rows`` method) rather than ``(input_ids, scores)``."""
    return callable(getattr(p, "process_rows", None))


def processor_name(p: Any) -> str:
    """How messages name a processor: a function's name, else its class's."""
    return getattr(p, "__name__", None) or type(p).__name__


# --------------------------------------------------------------------------------------------- #
# Building the chain
# --------------------------------------------------------------------------------------------- #


def _float_option(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    return float(value)


def _int_option(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    return int(value)


def _make(name: str, cls: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' processor ``cls(*args)``, its own validation errors naming the option."""
    try:
        return cls(*args, **kwargs)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{name}: {err}") from None


def _scalar(name: str, value: Any) -> Any:
    if value is None:
        return None
    arr = np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value)
    if arr.ndim == 0:
        return arr.item()
    flat = arr.reshape(-1)
    if flat.size and bool(np.all(flat == flat[0])):
        return flat[0].item()
    raise ValueError(
        f"{name}: min_p, typical_p, epsilon_cutoff and eta_cutoff apply after {name} (transformers' order), "
        f"which then takes one value for the batch; got per-row values {flat.tolist()[:8]}"
    )


def _merge(default: list[Any], custom: list[Any]) -> list[Any]:
    """transformers' rule (``GenerationMixin._merge_criteria_processor_list``): a custom processor of the type of a
    built one takes its place; the other custom ones follow, in their order."""
    out = [next((c for c in custom if type(c) is type(d)), d) for d in default]
    return out + [c for c in custom if not any(c is o for o in out)]


def build_processors(
    logits_processor: Any,
    options: dict[str, Any],
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    temperature: Any,
    top_k: Any,
    top_p: Any,
    constraint: Any = None,
) -> tuple[list[Any], tuple[Any, Any, Any]]:
    """The processor chain of a call, as transformers' ``generate`` builds it, and the acceptance step's parameters.

    Built options come first, in ``GenerationMixin._get_logits_processor``'s
    order and with its arguments (a repetition penalty ignores each row's left
    padding), then ``logits_processor`` merged in as transformers merges it.
    With sampling and any of :data:`WARPER_OPTIONS`, which transformers applies
    after temperature / top-k / top-p, those three join the chain as
    transformers' own warpers and the acceptance step gets temperature 1 and no
    top-k / top-p; otherwise it gets them unchanged. Greedy calls ignore the
    warper options, as ``generate(do_sample=False)`` does.

    Args:
      logits_processor: None, a ``LogitsProcessorList`` or a list of processors (see the module docstring).
      options: the built-in options by name (None = off), :data:`PROCESSOR_OPTIONS` and :data:`WARPER_OPTIONS`.
      input_ids: i64[B, P] the left-padded prompts; attention_mask: i64[B, P].
      max_new_tokens, eos_ids: the call's (``forced_eos_token_id`` and ``min_new_tokens`` need them).
      temperature, top_k, top_p: the call's sampling parameters.
      constraint: None, or a row processor that goes after the others and before the sampling filters
        (the grammar of ``json_schema=`` / ``regex=``, :mod:`specjax.generate.grammar`).

    Returns:
      ``(chain, (temperature, top_k, top_p))``: the processors in order (empty: none) and the
      sampling parameters for the acceptance step.

    Raises:
      TypeError: ``logits_processor`` is not a list of processors.
      ValueError: an option outside its range, naming it.
    """
    from transformers.generation import logits_process as lp

    custom: list[Any] = []
    if logits_processor is not None:
        if not isinstance(logits_processor, list | tuple):
            raise TypeError(
                "logits_processor: expected a transformers LogitsProcessorList or a list of processors "
                f"((input_ids, scores) -> scores callables or row processors), got {type(logits_processor).__name__}"
            )
        for i, p in enumerate(logits_processor):
            if not callable(p) and not is_row_processor(p):
                raise TypeError(
                    f"logits_processor: item {i} is a {type(p).__name__}, expected a callable (input_ids, scores) -> "
                    "scores or an object with process_rows(prefixes, scores)"
                )
            why = refusal(p)
            if why is not None:
                raise ValueError(
                    f"logits_processor: item {i}, {type(p).__name__}, {why}: it "
                    "cannot run under speculation (remove it, or use transformers' own generate)"
                )
        custom = list(logits_processor)
    unknown = sorted(set(options) - set(PROCESSOR_OPTIONS) - set(WARPER_OPTIONS))
    assert not unknown, unknown
    device = input_ids.device
    prompt_len = int(input_ids.shape[1])
    eos = torch.tensor(sorted(eos_ids), device=device) if eos_ids else None
    o = {k: v for k, v in options.items() if v is not None}
    built: list[Any] = []
    if "repetition_penalty" in o:
        penalty = _float_option("repetition_penalty", o["repetition_penalty"])
        if penalty != 1.0:
            padding = (attention_mask != 0).int().argmax(dim=1)  # each row's left padding, as generate passes it
            built.append(_make("repetition_penalty", lp.RepetitionPenaltyLogitsProcessor, penalty, padding))
    if "no_repeat_ngram_size" in o:
        size = _int_option("no_repeat_ngram_size", o["no_repeat_ngram_size"])
        if size > 0:
            built.append(_make("no_repeat_ngram_size", lp.NoRepeatNGramLogitsProcessor, size))
    if "bad_words_ids" in o:
        built.append(_make("bad_words_ids", lp.NoBadWordsLogitsProcessor, o["bad_words_ids"], eos))
    if "min_new_tokens" in o:
        count = _int_option("min_new_tokens", o["min_new_tokens"])
        if count > 0 and eos is not None:  # generate builds it only with an EOS id
            built.append(
                _make("min_new_tokens", lp.MinNewTokensLengthLogitsProcessor, prompt_len, count, eos, device=device)
            )
    if "forced_bos_token_id" in o:
        built.append(
            _make(
                "forced_bos_token_id",
                lp.ForcedBOSTokenLogitsProcessor,
                _int_option("forced_bos_token_id", o["forced_bos_token_id"]),
            )
        )
    if "forced_eos_token_id" in o:
        built.append(
            _make(
                "forced_eos_token_id",
                lp.ForcedEOSTokenLogitsProcessor,
                prompt_len + max_new_tokens,  # generate's max_length
                o["forced_eos_token_id"],
                device=device,
            )
        )
    if "suppress_tokens" in o:
        built.append(_make("suppress_tokens", lp.SuppressTokensLogitsProcessor, o["suppress_tokens"], device=device))
    if "begin_suppress_tokens" in o:
        begin = prompt_len if prompt_len > 1 or "forced_bos_token_id" not in o else prompt_len + 1
        built.append(
            _make(
                "begin_suppress_tokens",
                lp.SuppressTokensAtBeginLogitsProcessor,
                o["begin_suppress_tokens"],
                begin,
                device=device,
            )
        )
    chain = _merge(built, custom) + ([constraint] if constraint is not None else [])

    sampling = temperature is not None and bool(np.any(np.asarray(_host(temperature)) > 0))
    warpers: list[Any] = []
    for name, cls, active in (
        ("min_p", lp.MinPLogitsWarper, lambda v: True),
        ("typical_p", lp.TypicalLogitsWarper, lambda v: v < 1.0),
        ("epsilon_cutoff", lp.EpsilonLogitsWarper, lambda v: 0.0 < v < 1.0),
        ("eta_cutoff", lp.EtaLogitsWarper, lambda v: 0.0 < v < 1.0),
    ):
        if name in o:
            value = _float_option(name, o[name])
            if active(value):  # built (and so validated) greedy too, where generate ignores it
                kwargs = {"device": device} if cls is lp.EtaLogitsWarper else {}
                warper = _make(name, cls, value, **kwargs)
                if sampling:
                    warpers.append(warper)
    if not warpers:
        return chain, (temperature, top_k, top_p)
    t, k, p = _scalar("temperature", temperature), _scalar("top_k", top_k), _scalar("top_p", top_p)
    front: list[Any] = []
    if float(t) != 1.0:
        front.append(_make("temperature", lp.TemperatureLogitsWarper, float(t)))
    if k is not None and int(k) != 0:
        front.append(_make("top_k", lp.TopKLogitsWarper, int(k)))
    if p is not None and float(p) < 1.0:
        front.append(_make("top_p", lp.TopPLogitsWarper, float(p)))
    return chain + front + warpers, (1.0, None, None)


def _host(x: Any) -> Any:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x


def split_prepared(
    processors: Sequence[Any], do_sample: bool
) -> tuple[list[Any], tuple[float, int | None, float | None]]:
    """A list transformers' ``generate`` prepared, as ``(chain, (temperature, top_k, top_p))`` for the loop.

    The processors before transformers' first warper stay in the chain. A tail
    of warpers that the acceptance step implements with transformers'
    semantics (temperature, then top-k, then top-p, ``-inf`` filter, one token
    kept at least) becomes its parameters; any other tail (min-p, typical,
    epsilon, eta, another filter value, a ``LogitNormalization``, a
    watermark) joins the chain whole, transformers' own classes doing the
    arithmetic, and the acceptance step samples at temperature 1 (or argmax,
    greedy).
    """
    from transformers.generation import logits_process as lp

    kernel = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper)
    warpers = (*kernel, lp.MinPLogitsWarper, lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper)
    warpers += tuple(c for c in (getattr(lp, "TopHLogitsWarper", None),) if c is not None)
    items = list(processors)
    first = next((i for i, p in enumerate(items) if type(p) in warpers), len(items))
    head, tail = items[:first], items[first:]
    kinds = [type(p) for p in tail]
    simple = (
        len(set(kinds)) == len(kinds)
        and all(k in kernel for k in kinds)
        and kinds == sorted(kinds, key=kernel.index)
        and all(float(getattr(p, "filter_value", -math.inf)) == -math.inf for p in tail)
        and all(int(getattr(p, "min_tokens_to_keep", 1)) == 1 for p in tail)
    )
    if not do_sample:
        return head + tail, (0.0, None, None)
    if not simple:
        return head + tail, (1.0, None, None)
    temperature, top_k, top_p = 1.0, None, None
    for p in tail:
        if isinstance(p, lp.TemperatureLogitsWarper):
            temperature = float(p.temperature)
        elif isinstance(p, lp.TopKLogitsWarper):
            top_k = int(p.top_k)
        else:
            top_p = float(p.top_p)
    return head, (temperature, top_k, top_p)


# --------------------------------------------------------------------------------------------- #
# Running the chain in the loop
# --------------------------------------------------------------------------------------------- #


class LoopProcessors:
    """A call's processor chain and the rows' token history (see the module docstring).

    Args:
      chain: the processors, in order (:func:`build_processors`).
      input_ids: i64[B, P] the left-padded prompts (``generate``'s view starts with them).
      max_new_tokens, max_draft: the call's; they bound the history's width.
      vocab: V, the target's vocabulary size (draft logits are cut or padded to it).
      pad_token_id: the stand-in rows' and :class:`Prefixes`' padding.

    transformers' built-in processors in the chain run as row processors
    (:func:`specjax.generate.row_processors.vectorised`): one call each on all
    the positions of a batch, where a callable is called once per distinct
    prefix length. ``calls`` counts the processors' calls, ``seconds`` the time
    spent in them.
    """

    def __init__(
        self,
        chain: list[Any],
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        max_draft: int,
        vocab: int,
        pad_token_id: int,
    ) -> None:
        self.chain = [vectorised(p) or p for p in chain]
        self.device = input_ids.device
        batch, self.prompt_len = (int(n) for n in input_ids.shape)
        self.vocab, self.pad = vocab, pad_token_id
        # hist[b]: the prompt, row b's committed tokens (t[b] of them), then scratch for its draft tokens; a view
        # into a buffer with as many pad columns before it, from which right-aligned prefixes are read as windows
        width = self.prompt_len + max_new_tokens + max_draft + 2
        self._padded = np.full((batch, 2 * width), pad_token_id, np.int64)
        self.hist = self._padded[:, width:]
        self.hist[:, : self.prompt_len] = input_ids.cpu().numpy()
        self.t = np.zeros(batch, np.int64)
        self.seconds = 0.0
        self.calls = 0
        for p in self.chain:
            start = getattr(p, "start", None)
            if is_row_processor(p) and callable(start):
                start(batch, self.prompt_len)

    # -- the loop's three calls ------------------------------------------------------------------

    def draft_hook(self, cache_rows: Sequence[int], active: np.ndarray) -> Callable[[Any, np.ndarray], torch.Tensor]:
        """The drafter's ``DraftRequest.process`` for one step: ``(logits f[B', V_draft], drafted i64[B', i]) ->
        f32[B', V]``, the logits of draft position ``i`` processed (active rows; the others only cut to V)."""
        rows_c = np.nonzero(active)[0]
        orig = np.asarray(cache_rows, np.int64)[rows_c]

        def process(logits: Any, drafted: np.ndarray) -> torch.Tensor:
            t0 = time.perf_counter()
            with torch.inference_mode():
                scores = self._fit(logits)
                i = int(drafted.shape[1])
                if i:
                    self._write(orig, np.asarray(drafted, np.int64)[rows_c])
                committed = self.prompt_len + self.t[orig]
                if rows_c.size == scores.shape[0]:  # every row: no gather and write-back
                    scores = self._apply(scores, orig, committed + i, committed)
                else:
                    rows_t = torch.as_tensor(rows_c, device=scores.device)
                    scores[rows_t] = self._apply(scores[rows_t], orig, committed + i, committed)
            self.seconds += time.perf_counter() - t0
            return scores

        return process

    def target(
        self, logits: torch.Tensor, draft: torch.Tensor, k: np.ndarray, active: np.ndarray, cache_rows: Sequence[int]
    ) -> torch.Tensor:
        """The target's logits f[B', W+1, V] processed: f32[B', W+1, V].

        ``draft``: i64[B', W] the step's draft columns; ``k``: i64[B'] each row's
        draft tokens; ``active``: bool[B']. Row b's positions ``0 .. k_b`` are
        processed (the later ones are never read), inactive rows not at all.
        """
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = logits.to(torch.float32, copy=True)
            rows_c = np.nonzero(active)[0]
            if rows_c.size:
                counts = k[rows_c].astype(np.int64) + 1
                pair_row = np.repeat(rows_c, counts)
                pair_pos = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
                orig_c = np.asarray(cache_rows, np.int64)[rows_c]
                g = int(k.max(initial=0))
                if g:
                    self._write(orig_c, draft[:, :g].cpu().numpy()[rows_c])
                orig = np.asarray(cache_rows, np.int64)[pair_row]
                committed = self.prompt_len + self.t[orig]
                if pair_row.size == out.shape[0] * out.shape[1]:  # every (row, position): the pairs in order
                    flat = out.view(pair_row.size, out.shape[2])
                    out = self._apply(flat, orig, committed + pair_pos, committed).view(out.shape)
                else:
                    idx = (torch.as_tensor(pair_row, device=out.device), torch.as_tensor(pair_pos, device=out.device))
                    out[idx] = self._apply(out[idx], orig, committed + pair_pos, committed)
        self.seconds += time.perf_counter() - t0
        return out

    def commit(self, cache_rows: Sequence[int], emitted: list[list[int]]) -> None:
        """Append each row's committed tokens (``emitted[j]`` for cache row j) to its history."""
        for j, e in enumerate(emitted):
            if e:
                b = cache_rows[j]
                start = self.prompt_len + int(self.t[b])
                self.hist[b, start : start + len(e)] = e
                self.t[b] += len(e)

    # -- internals --------------------------------------------------------------------------------

    def _fit(self, logits: Any) -> torch.Tensor:
        """f32[B', V] (a new tensor): torch logits cut or padded (``-inf``) to the target's vocabulary."""
        if not isinstance(logits, torch.Tensor):
            from specjax.adapters import to_torch

            logits = to_torch(logits)
        width = int(logits.shape[-1])
        x = logits[:, : self.vocab].to(torch.float32, copy=True)
        if width < self.vocab:
            x = torch.nn.functional.pad(x, (0, self.vocab - width), value=-math.inf)
        return x

    def _write(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Draft tokens i64[R, i] into the scratch after rows' committed tokens (``rows``: i64[R] batch rows)."""
        cols = self.prompt_len + self.t[rows][:, None] + np.arange(tokens.shape[1])[None, :]
        self.hist[rows[:, None], cols] = tokens

    def _apply(
        self, scores: torch.Tensor, rows: np.ndarray, lengths: np.ndarray, committed: np.ndarray
    ) -> torch.Tensor:
        """The chain on f32[N, V] ``scores``: scores row n is batch row ``rows[n]`` after a prefix of ``lengths[n]``
        tokens (the history's first ones, drafts written), ``committed[n]`` of them committed."""
        prefixes: Prefixes | None = None
        i = 0
        while i < len(self.chain):
            if is_row_processor(self.chain[i]):
                if prefixes is None:
                    prefixes = self._prefixes(rows, lengths, committed)
                p = self.chain[i]
                self.calls += 1
                scores = _checked(p, p.process_rows(prefixes, scores), tuple(scores.shape))
                i += 1
                continue
            j = i
            while j < len(self.chain) and not is_row_processor(self.chain[j]):
                j += 1
            scores = self._grouped(self.chain[i:j], scores, rows, lengths)
            i = j
        return scores

    def _grouped(self, run: list[Any], scores: torch.Tensor, rows: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        """transformers-style processors: one call of each per distinct prefix length, with the whole batch."""
        batch = self.hist.shape[0]
        out = torch.empty_like(scores)
        for length in np.unique(lengths):
            sel = np.nonzero(lengths == length)[0]
            r = torch.as_tensor(rows[sel], device=scores.device)
            sel_t = torch.as_tensor(sel, device=scores.device)
            ids = torch.as_tensor(np.ascontiguousarray(self.hist[:, :length]), device=self.device)
            full = scores.new_zeros((batch, scores.shape[1]))
            full[r] = scores[sel_t]
            for p in run:
                self.calls += 1
                full = _checked(p, p(ids, full), (batch, scores.shape[1]))
            out[sel_t] = full[r]
        return out

    def _prefixes(self, rows: np.ndarray, lengths: np.ndarray, committed: np.ndarray) -> Prefixes:
        """The :class:`Prefixes` of one batch (the chain's row processors share it: they read it, never write)."""
        width = int(lengths.max(initial=0))
        gap = self._padded.shape[1] - self.hist.shape[1]
        ids = sliding_window_view(self._padded, width, axis=1)[rows, gap + lengths - width]  # a copy
        return Prefixes(rows.copy(), ids, lengths.copy(), committed.copy(), self.prompt_len)


def _checked(p: Any, out: Any, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise PluginOutputError(
            f"logits_processor {processor_name(p)} returned {got}, expected a torch tensor of shape {shape} "
            "(the processed scores)"
        )
    return out
