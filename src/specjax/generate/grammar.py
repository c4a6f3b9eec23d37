"""Grammar-constrained output under speculation: a JSON schema or a regular expression, through xgrammar.

A grammar is a prefix-dependent logits processor: at each position, the tokens
that keep the output a prefix of a word of the grammar keep their logits, every
other token gets ``-inf`` (transformers and vLLM apply it the same way, before
temperature, top-k and top-p). Speculation stays exact when the target's
logits at draft position ``i`` are masked with the grammar's state after the
committed tokens *and* draft tokens ``x_0 .. x_{i-1}``, the prefix plain
decoding would have seen there (Leviathan et al. 2023, arXiv:2211.17192; Chen
et al. 2023, arXiv:2302.01318: the acceptance test then follows the masked
distribution). So each step, per row:

1. :meth:`GrammarRows.valid_prefix`: point-mass proposals (n-gram lookups, the
   ``hybrid`` drafter's n-gram rows, any proposal of a greedy call) are cut at
   their first token the grammar refuses. Exact: such a token has masked target
   probability 0, so it would be rejected with certainty and the emitted token
   drawn from the masked target distribution there, which is what the bonus
   token of the cut proposal is drawn from. Sampled proposals are not cut (a
   count chosen from the drawn tokens would bias the output; the masked target
   rejects an invalid token instead).
2. :meth:`GrammarRows.draft_masks`: the matcher is advanced along the draft,
   filling the bitmask of each of the ``k_b + 1`` positions; it stops at a
   refused token (later positions are never reached: all tokens allowed there).
3. :meth:`GrammarRows.mask_logits`: ``-inf`` where a position's bitmask is 0.
4. :meth:`GrammarRows.commit`: after verification the matcher is rolled back to
   the accepted prefix and advanced along the emitted (correction or bonus)
   token.

The library is xgrammar (what vLLM uses), chosen by measurement on the SmolLM2
tokenizer (docs/grammar.md): its token bitmask costs microseconds per position
and its rollback is O(1) per token. It is an optional dependency (``pip install
specjax[grammar]``), imported when a grammar is compiled.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specjax.slots import to_host

__all__ = ["GrammarRows", "GrammarSpec", "compile_grammar", "grammar_spec"]

_INSTALL_HINT = "install it with `pip install 'specjax[grammar]'` (or `pip install xgrammar`)"


@dataclass(frozen=True)
class GrammarSpec:
    """What a call constrains its output to: ``kind`` is ``"json_schema"`` or ``"regex"``, ``source`` its text.

    A JSON schema's text is the schema serialised with :func:`json.dumps`.
    """

    kind: str
    source: str


def grammar_spec(json_schema: Any = None, regex: Any = None) -> GrammarSpec | None:
    """The call's constraint from ``speculative_generate``'s arguments (None: unconstrained).

    Args:
      json_schema: None, a JSON schema as a dict, as JSON text, or a pydantic
        model class (its ``model_json_schema()``).
      regex: None, or a regular expression (str) the whole output must match.

    Raises:
      ValueError: both given, a schema that is not JSON text or a JSON object,
        or an empty regex.
      TypeError: an argument of another type.
    """
    if json_schema is not None and regex is not None:
        raise ValueError("json_schema, regex: expected at most one output constraint, got both")
    if regex is not None:
        if not isinstance(regex, str):
            raise TypeError(f"regex: expected a regular expression (str), got {type(regex).__name__}")
        if not regex:
            raise ValueError("regex: expected a non-empty regular expression, got ''")
        return GrammarSpec("regex", regex)
    if json_schema is None:
        return None
    schema_of = getattr(json_schema, "model_json_schema", None)
    if isinstance(json_schema, type) and callable(schema_of):  # a pydantic model class
        json_schema = schema_of()
    if isinstance(json_schema, str):
        try:
            parsed = json.loads(json_schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"json_schema: expected a JSON schema, got text that is not JSON ({err})") from None
        json_schema = parsed
    if isinstance(json_schema, bool) or not isinstance(json_schema, dict):
        raise (ValueError if isinstance(json_schema, list | int | float | bool) else TypeError)(
            "json_schema: expected a JSON schema (a dict, JSON text or a pydantic model class), got "
            f"{type(json_schema).__name__}"
        )
    return GrammarSpec("json_schema", json.dumps(json_schema))


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError(f"json_schema / regex: grammar-constrained output needs xgrammar; {_INSTALL_HINT}") from err
    return xgrammar


# xgrammar's tokenizer tables (one pass over the vocabulary, ~0.1 s for 49k tokens) and its
# compiler (with its cache of compiled grammars), per tokenizer object and vocabulary size.
_COMPILERS: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def _compiler(tokenizer: Any, vocab_size: int) -> Any:
    xgr = _xgrammar()
    per_tok = _COMPILERS.setdefault(tokenizer, {})
    if vocab_size not in per_tok:
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        except Exception as err:
            raise ValueError(
                f"target_tokenizer: xgrammar could not read {type(tokenizer).__name__} ({err}); pass the "
                "target's Hugging Face tokenizer"
            ) from None
        per_tok[vocab_size] = xgr.GrammarCompiler(info)
    return per_tok[vocab_size]


def compile_grammar(spec: GrammarSpec, tokenizer: Any, vocab_size: int) -> Any:
    """``spec`` compiled against ``tokenizer`` for logits of width ``vocab_size`` (an ``xgrammar.CompiledGrammar``).

    JSON schemas compile without free whitespace (``", "`` and ``": "`` between
    items): a model can otherwise spend its tokens on whitespace forever, and
    the output is the same JSON. Compiled grammars are cached per tokenizer.

    Raises:
      ValueError: ``tokenizer`` is None or unreadable, or the schema / regex
        does not compile (xgrammar's reason is quoted).
      ImportError: xgrammar is not installed.
    """
    if tokenizer is None:
        raise ValueError(
            f"target_tokenizer: {spec.kind} needs the target's tokenizer to map the grammar onto token ids; "
            "pass target_tokenizer=..."
        )
    compiler = _compiler(tokenizer, vocab_size)
    try:
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        return compiler.compile_json_schema(spec.source, any_whitespace=False)
    except RuntimeError as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ValueError(f"{spec.kind}: xgrammar cannot compile it: {reason}") from None


def _unpack(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """bool[..., vocab] on ``device`` from i32[..., ceil(vocab / 32)] bitmasks (token t: bit t % 32 of word t // 32)."""
    words = torch.from_numpy(bitmask).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab].bool()


class GrammarRows:
    """One grammar matcher per row of the loop's batch (host state; xgrammar's ``GrammarMatcher``).

    Each matcher holds the row's committed tokens plus the draft tokens it was
    advanced along by the last :meth:`draft_masks` (``advanced[b]`` of them),
    which :meth:`commit` rolls back.

    Args:
      compiled: the ``xgrammar.CompiledGrammar`` (:func:`compile_grammar`).
      batch: B, the rows.
      stop_ids: the token ids that end a row (the call's EOS ids): the grammar
        allows them, and only them, once the output is complete.
      vocab: V, the width of the logits the masks apply to.
      name: the argument the grammar came from, for messages (``json_schema`` or ``regex``).
    """

    def __init__(self, compiled: Any, batch: int, stop_ids: list[int], vocab: int, name: str = "grammar") -> None:
        self.vocab, self.name, self.compiled, self.stop_ids = vocab, name, compiled, list(stop_ids)
        self.words = (vocab + 31) // 32
        self.start(batch, 0)
        self._drawing: list[int | None] = []  # per row: draft draws fed to its matcher (None: refused/ended)

    def process_draft(self, position: int, logits: Any, previous: Any) -> Any:
        """A model drafter's logits at draft ``position`` (0-based), masked like the target's there.

        The drafter calls this once per position, in order (through
        :attr:`specjax.drafters.DraftRequest.process`): ``logits`` f[B', V'] (torch)
        and ``previous`` the tokens it drew at ``position - 1`` (i[B'], any array
        library; None at position 0). The matchers advance along the draws;
        :meth:`end_draft` takes them back to the committed tokens. Drawing from
        the masked logits only proposes tokens the grammar allows: the
        draft's distribution is then the masked one (the proposal's logits are
        these), which the acceptance test needs.
        """
        if position == 0:
            self.end_draft()
            self._drawing = [0 if not m.is_terminated() else None for m in self.matchers]
        else:
            drawn = np.asarray(to_host(previous)).reshape(-1)
            for b, m in enumerate(self.matchers):
                count = self._drawing[b]
                if count is None:
                    continue
                if not m.accept_token(int(drawn[b])):  # a row that does not draft: its draws do not matter
                    m.rollback(count)
                    self._drawing[b] = None
                elif m.is_terminated():  # drew a stop token: the row's draft ends there
                    m.rollback(count + 1)
                    self._drawing[b] = None
                else:
                    self._drawing[b] = count + 1
        masks = np.full((len(self.matchers), self.words), -1, np.int32)
        for b, m in enumerate(self.matchers):
            if self._drawing[b] is not None:
                self._fill(m, masks, b)
        return self.mask_logits(logits[:, None], masks[:, None])[:, 0]

    def end_draft(self) -> None:
        """Take the matchers back to the committed tokens after :meth:`process_draft` (no-op otherwise)."""
        for m, count in zip(self.matchers, self._drawing, strict=False):
            if count:
                m.rollback(count)
        self._drawing = []

    def valid_prefix(self, tokens: np.ndarray, k: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """i64[B']: ``k`` cut, in the ``rows`` (bool[B']), to each proposal's longest grammar-valid prefix.

        ``tokens``: i64[B', G] host array of proposals, row b's first ``k[b]``
        used. The matchers end where they began.
        """
        out = np.asarray(k, np.int64).copy()
        for b in np.nonzero(np.asarray(rows) & (out > 0))[0]:
            m = self.matchers[b]
            valid = 0
            while valid < out[b] and not m.is_terminated() and m.accept_token(int(tokens[b, valid])):
                valid += 1
            if valid:
                m.rollback(valid)
            out[b] = valid
        return out

    def draft_masks(self, tokens: np.ndarray, k: np.ndarray, active: np.ndarray) -> np.ndarray:
        """i32[B', W+1, ceil(V/32)] bitmasks of the positions the target scores, ``[last, x_0 .. x_{W-1}]``.

        Row b's position ``i <= k[b]`` gets the grammar's mask after its
        committed tokens and ``x_0 .. x_{i-1}``; positions after a refused token
        (never reached: that token is rejected), after the end of the grammar,
        and in inactive rows allow every token. ``tokens``: i64[B', W] host
        array; ``k``: i64[B']; ``active``: bool[B'].
        """
        b_now, width = tokens.shape
        masks = np.full((b_now, width + 1, self.words), -1, np.int32)
        flat = masks.reshape(b_now * (width + 1), self.words)
        for b in range(b_now):
            m, self.advanced[b], self.drafted[b] = self.matchers[b], 0, []
            if not active[b] or m.is_terminated():
                continue
            for i in range(int(k[b]) + 1):
                self._fill(m, flat, b * (width + 1) + i)
                if i == int(k[b]):
                    break
                t = int(tokens[b, i])
                if not m.accept_token(t):
                    break
                self.advanced[b] += 1
                self.drafted[b].append(t)
                if m.is_terminated():
                    break
        return masks

    def mask_logits(self, logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
        """``logits`` (f[B', W+1, V'], torch) with ``-inf`` where ``masks`` (:meth:`draft_masks`) refuse a token.

        Ids at or past the grammar's vocabulary V (padding) are refused.
        """
        allowed = _unpack(masks, min(self.vocab, logits.shape[-1]), logits.device)
        if logits.shape[-1] > allowed.shape[-1]:
            pad = torch.zeros((*allowed.shape[:-1], logits.shape[-1] - allowed.shape[-1]), dtype=torch.bool)
            allowed = torch.cat([allowed, pad.to(logits.device)], dim=-1)
        return logits.masked_fill(~allowed, float("-inf"))

    def commit(self, emitted: list[list[int]]) -> None:
        """Roll each matcher back to the accepted prefix and advance it along the row's emitted tokens.

        ``emitted``: B' host lists, each row's committed tokens this step (its
        accepted draft tokens, then the correction or bonus token; empty for
        finished rows).

        Raises:
          RuntimeError: an emitted token the grammar refuses (the masked target
            gives it probability 0: a broken invariant, not user error).
        """
        for b, (m, new) in enumerate(zip(self.matchers, emitted, strict=True)):
            drafted = self.drafted[b]
            same = 0
            while same < min(len(drafted), len(new)) and drafted[same] == new[same]:
                same += 1
            if self.advanced[b] > same:
                m.rollback(self.advanced[b] - same)
            self.advanced[b], self.drafted[b] = 0, []
            for t in new[same:]:
                if m.is_terminated():
                    break
                if not m.accept_token(int(t)):
                    raise RuntimeError(
                        f"grammar: row {b} emitted token {int(t)}, which the grammar does not allow after the "
                        "row's output so far (its masked probability is 0)"
                    )

    # -- as a row processor of the loop's processor chain (:mod:`specjax.generate.processors`) -------

    def start(self, batch: int, prompt_length: int) -> None:
        """Fresh matchers for ``batch`` rows, indexed by batch row (a row processor's ``start``)."""
        self.matchers = [self._new_matcher() for _ in range(batch)]
        self.advanced = [0] * batch
        self.drafted: list[list[int]] = [[] for _ in range(batch)]
        self.fed: list[list[int]] = [[] for _ in range(batch)]  # _follow's record of what each matcher holds
        self.stable = [0] * batch
        self.prompt_length = prompt_length

    def process_rows(self, prefixes: Any, scores: torch.Tensor) -> torch.Tensor:
        """f[N, V] ``scores`` masked, scores row n with the grammar's state after its prefix's generated tokens.

        ``prefixes``: a :class:`specjax.generate.processors.Prefixes` (``rows``,
        ``lengths``, ``committed``, ``prefix(n)``; the first ``prompt_length``
        tokens of a prefix are the prompt's columns). A row's matcher follows
        the prefixes it is asked about: it rolls back to where the new prefix
        leaves the tokens it has seen and advances from there, so calls may
        come in any order (a drafter's positions, then the target's).
        Positions after a refused token or the end of the grammar allow every
        token (they are never reached).
        """
        masks = np.full((len(prefixes.rows), self.words), -1, np.int32)
        for n, row in enumerate(np.asarray(prefixes.rows)):
            generated = prefixes.prefix(n)[self.prompt_length :]
            if self._follow(int(row), generated, int(prefixes.committed[n]) - self.prompt_length):
                self._fill(self.matchers[int(row)], masks, n)
        return self.mask_logits(scores[:, None], masks[:, None])[:, 0]

    def _follow(self, row: int, tokens: Any, committed: int) -> bool:
        """Bring row ``row``'s matcher to the state after ``tokens`` (its generated tokens, the first
        ``committed`` of them committed): whether it holds them all and has not ended."""
        m, fed = self.matchers[row], self.fed[row]
        same = min(self.stable[row], len(fed), len(tokens))
        while same < min(len(fed), len(tokens)) and fed[same] == int(tokens[same]):
            same += 1
        if len(fed) > same:
            m.rollback(len(fed) - same)
            del fed[same:]
        ok = True
        for t in tokens[same:]:
            if m.is_terminated() or not m.accept_token(int(t)):
                ok = False
                break
            fed.append(int(t))
        self.stable[row] = max(self.stable[row], min(committed, len(fed)))
        return ok and not m.is_terminated()

    def _new_matcher(self) -> Any:
        return _xgrammar().GrammarMatcher(self.compiled, override_stop_tokens=list(self.stop_ids))

    def _fill(self, matcher: Any, masks: np.ndarray, index: int) -> None:
        """``masks[index]`` = the matcher's next-token bitmask, or a ValueError when it allows no token."""
        matcher.fill_next_token_bitmask(masks, index)
        if not masks[index].any():
            raise ValueError(
                f"{self.name}: no token of the tokenizer continues the output under the grammar (the "
                "tokenizer cannot spell what the grammar requires next); check that the schema or regex fits "
                "the tokenizer's vocabulary"
            )

    def select_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices into the current rows), in that order."""
        self.matchers = [self.matchers[j] for j in rows]
        self.advanced = [self.advanced[j] for j in rows]
        self.drafted = [self.drafted[j] for j in rows]
