"""Grammar-constrained output under speculation: a JSON schema or a regular expression, through xgrammar.

A grammar is a prefix-dependent logits processor: at each position, the tokens
that keep the output a prefix of a word of the grammar keep their logits, every
other token gets ``-inf`` (transformers and vLLM apply it the same way, before
temperature, top-k and top-p). Speculation stays exact when the target's
logits at draft position ``i`` are masked with the grammar's state after the
committed tokens *and* draft tokens ``x_0 .. x_{i-1}``, the prefix plain
decoding would have seen there (Leviathan et al. 2023, arXiv:2211.17192; Chen
et al. 2023, arXiv:2302.01318: the acceptance test then follows the masked
distribution). :class:`GrammarRows` is a row processor of the loop's
processor chain (:mod:`specjax.generate.processors`), which calls it with the
prefix of each position it processes, a model drafter's as it draws and the
target's, so that a drafter proposes only tokens the grammar allows and the
acceptance test runs on the masked distributions. One matcher per row follows
the prefixes it is asked about, rolling back to where a new prefix leaves the
tokens it holds (the accepted prefix, at the next step); no commit call.

Besides, :meth:`GrammarRows.valid_prefix` cuts point-mass proposals (n-gram
lookups, the ``hybrid`` drafter's n-gram rows, any proposal of a greedy call)
at their first token the grammar refuses. Exact: such a token has masked
target probability 0, so it would be rejected with certainty and the emitted
token drawn from the masked target distribution there, which is what the bonus
token of the cut proposal is drawn from. Sampled proposals are not cut (a count
chosen from the drawn tokens would bias the output; the masked target rejects
an invalid token instead).

:meth:`GrammarRows.forced_extension` merges the tokens the grammar forces
(keys, punctuation, EOS after a complete output) into those proposals and into
rows that propose nothing: free drafts, exact as point masses (docs/grammar.md).

The library is xgrammar (what vLLM uses), chosen by measurement on the SmolLM2
tokenizer (docs/grammar.md): its token bitmask costs microseconds per position
and its rollback is O(1) per token. It is an optional dependency (``pip install
specjax[grammar]``), imported when a grammar is compiled.
"""

from __future__ import annotations

import json
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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
    try:
        per_tok = _COMPILERS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: compiled for this call only
        per_tok = {}
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
    if device.type == "cpu" and sys.byteorder == "little":  # bit t % 8 of byte t // 8: NumPy's, 15x torch's here
        unpacked = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(unpacked[..., :vocab].view(np.bool_))
    return _unpack_on_device(bitmask, vocab, device)


def _unpack_on_device(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """:func:`_unpack` with torch on ``device`` (an accelerator: the bitmask crosses, 32 times smaller)."""
    words = torch.from_numpy(bitmask).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab].bool()


class GrammarRows:
    """One grammar matcher per batch row (host state; xgrammar's ``GrammarMatcher``).

    A row's matcher follows the prefixes it is asked about: asked for the mask
    after a row's generated tokens, it rolls back to where they leave what it
    holds and advances from there (xgrammar rolls back in O(1) per token). So
    the drafter's positions, the target's positions and the next step's need no
    explicit commit or rollback call, and the calls may come in any order.
    Committed tokens are never compared again (``stable``).

    Args:
      compiled: the ``xgrammar.CompiledGrammar`` (:func:`compile_grammar`).
      batch: B, the rows.
      stop_ids: the token ids that end a row (the call's EOS ids): the grammar
        allows them, and only them, once the output is complete.
      vocab: V, the width of the logits the masks apply to.
      name: the argument the grammar came from, for messages (``json_schema`` or ``regex``).
      encode: None, or the tokenizer's ``text -> ids`` (no special tokens), to tokenise the strings the
        grammar forces (:meth:`forced_extension`).
    """

    def __init__(
        self,
        compiled: Any,
        batch: int,
        stop_ids: list[int],
        vocab: int,
        name: str = "grammar",
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        self.vocab, self.name, self.compiled, self.stop_ids = vocab, name, compiled, list(stop_ids)
        self.words = (vocab + 31) // 32
        self.encode = encode
        self._encoded: dict[str, list[int]] = {}
        self._mask1 = np.zeros((1, self.words), np.int32)
        self.start(batch, 0)

    def start(self, batch: int, prompt_length: int) -> None:
        """Fresh matchers for ``batch`` rows (also a row processor's ``start``: ``prompt_length`` columns of each
        prefix :meth:`process_rows` sees are the prompt's)."""
        xgr = _xgrammar()
        self.matchers = [xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_ids) for _ in range(batch)]
        self.fed: list[list[int]] = [[] for _ in range(batch)]  # the generated tokens each matcher holds
        self.stable = [0] * batch  # how many of them are committed
        self.prompt_length = prompt_length
        self._step: tuple[list[int], list[list[int]]] = ([], [])

    # -- the loop's cut (specjax.generate.loop) ---------------------------------------------------

    def begin_step(self, rows: list[int], generated: list[list[int]]) -> None:
        """The step's cache rows: ``rows[j]`` the batch row of cache row j, ``generated[j]`` its committed
        generated tokens (read, not copied: unchanged until the step commits)."""
        self._step = (list(rows), generated)

    def valid_prefix(self, tokens: np.ndarray, k: np.ndarray, cut: np.ndarray) -> np.ndarray:
        """i64[B']: ``k`` cut, in the rows ``cut`` (bool[B']), to each proposal's longest grammar-valid prefix.

        ``tokens``: i64[B', G] host array of proposals, row j's first ``k[j]`` used.
        """
        rows, generated = self._step
        out = np.asarray(k, np.int64).copy()
        for j in np.nonzero(np.asarray(cut) & (out > 0))[0]:
            gen = generated[j]
            self._follow(rows[j], gen, tokens[j, : out[j]].tolist(), len(gen))
            out[j] = max(len(self.fed[rows[j]]) - len(gen), 0)
        return out

    def forced_extension(
        self, tokens: np.ndarray, k: np.ndarray, rows: np.ndarray, caps: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The proposals of ``rows`` (bool[B']) with the tokens the grammar forces, up to ``caps`` (i64[B']) each.

        ``tokens``: i64[B', g] host array, row j's first ``k[j]`` (i64[B'])
        used and valid under the grammar (:meth:`valid_prefix`). Row j's new
        proposal follows its own while the grammar forces nothing; where it
        forces text (:meth:`_forced_here`), the forced tokens come, and the
        row's own tokens go on only while they are those tokens (after the
        first one that differs they continued another prefix). After the own
        tokens, forced ones while any are. Returns ``(tokens', k', own)``:
        i64[B', g'], i64[B'] the new counts, i64[B'] how many of them are the
        row's own proposal (a common prefix; the rest the grammar forced).
        Rows not in ``rows`` keep their proposal.
        """
        steps, generated = self._step
        k = np.asarray(k, np.int64)
        new: dict[int, tuple[list[int], int]] = {}
        for j in np.nonzero(np.asarray(rows) & (np.asarray(caps) > 0))[0].tolist():
            gen = generated[j]
            if self._follow(steps[j], gen, (), len(gen)):
                new[j] = self._merged(steps[j], tokens[j, : k[j]].tolist(), int(caps[j]))
        k2, own = k.copy(), k.copy()
        for j, (props, mine) in new.items():
            k2[j], own[j] = len(props), mine
        out = np.zeros((len(k), int(k2.max(initial=0))), np.int64)
        width = min(tokens.shape[1], out.shape[1])
        out[:, :width] = tokens[:, :width]
        for j, (props, _) in new.items():
            out[j, : len(props)] = props
        return out, k2, own

    def _merged(self, row: int, drafted: list[int], cap: int) -> tuple[list[int], int]:
        """Row ``row``'s proposal from its matcher's state (the committed tokens): ``drafted`` merged with the
        forced tokens (see :meth:`forced_extension`), fed to the matcher; and how many lead it as drafted."""
        m, fed, out, own = self.matchers[row], self.fed[row], list[int](), 0
        synced = True
        while len(out) < cap and not m.is_terminated():
            forced = self._forced_here(m)[: cap - len(out)]
            taken = 0
            for t in forced:
                if not m.accept_token(t):
                    break
                fed.append(t)
                out.append(t)
                taken += 1
                synced = synced and own < len(drafted) and drafted[own] == t
                own += synced
            if taken:
                if taken < len(forced):
                    break
                continue
            if not synced or own >= len(drafted) or not m.accept_token(drafted[own]):
                break
            fed.append(drafted[own])
            out.append(drafted[own])
            own += 1
        return out, own

    def _forced_here(self, m: Any) -> list[int]:
        """The tokens the grammar forces from matcher ``m``'s state (not fed): its jump-forward string (keys,
        ``": "``, closing brackets) as the tokenizer encodes it (``encode``; without one, xgrammar's own
        longest-match tokens); where nothing is forced but the mask allows one token (EOS once the output is
        complete), that token. Any tokenisation is exact as a point-mass proposal; the tokenizer's is the one
        a model trained on it tends to choose."""
        text = m.find_jump_forward_string()
        cand = self._encode(text) if text and self.encode is not None else m.find_jump_forward_tokens()
        return cand or self._only_token(m)

    def _encode(self, text: str) -> list[int]:
        """The tokenizer's ids for ``text`` (cached: a schema's forced strings recur)."""
        ids = self._encoded.get(text)
        if ids is None:
            assert self.encode is not None
            ids = self._encoded[text] = [int(t) for t in self.encode(text)]
        return ids

    def _only_token(self, m: Any) -> list[int]:
        """``[t]`` when ``m``'s mask allows the one token t, else ``[]``."""
        m.fill_next_token_bitmask(self._mask1, 0)
        words = np.flatnonzero(self._mask1[0])
        if words.size != 1:
            return []
        w = int(self._mask1[0, words[0]]) & 0xFFFFFFFF
        t = int(words[0]) * 32 + w.bit_length() - 1
        return [t] if w & (w - 1) == 0 and t < self.vocab else []

    def mask_logits(self, logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
        """``logits`` (f[..., V'], torch) with ``-inf`` where ``masks`` (i32[..., ceil(V/32)]) refuse a token.

        Ids at or past the grammar's vocabulary V (padding) are refused.
        """
        allowed = _unpack(masks, min(self.vocab, logits.shape[-1]), logits.device)
        if logits.shape[-1] > allowed.shape[-1]:
            pad = torch.zeros((*allowed.shape[:-1], logits.shape[-1] - allowed.shape[-1]), dtype=torch.bool)
            allowed = torch.cat([allowed, pad.to(logits.device)], dim=-1)
        return torch.where(allowed, logits, float("-inf"))

    # -- as a row processor of the loop's processor chain (specjax.generate.processors) -------------

    def process_rows(self, prefixes: Any, scores: torch.Tensor) -> torch.Tensor:
        """f[N, V] ``scores`` masked, scores row n with the grammar's state after its prefix's generated tokens.

        ``prefixes``: a ``specjax.generate.row_processors.Prefixes`` (``rows``,
        ``committed``, ``prefix(n)``; each prefix's first ``prompt_length``
        tokens, as :meth:`start` was told, are the prompt's columns).
        """
        p = self.prompt_length
        items = [
            (int(row), prefixes.prefix(n)[p:], (), int(prefixes.committed[n]) - p)
            for n, row in enumerate(np.asarray(prefixes.rows))
        ]
        return self.mask_logits(scores[:, None], self._masks(items)[:, None])[:, 0]

    # -- internals ---------------------------------------------------------------------------------

    def _masks(self, items: list[tuple[int, Any, Any, int]]) -> np.ndarray:
        """i32[N, ceil(V/32)]: for each ``(row, head, tail, committed)``, the mask after the generated tokens
        ``head + tail`` (all ones where they are refused or the grammar has ended)."""
        masks = np.full((len(items), self.words), -1, np.int32)
        for n, (row, head, tail, committed) in enumerate(items):
            if self._follow(row, head, tail, committed):
                m = self.matchers[row]
                m.fill_next_token_bitmask(masks, n)
                if not masks[n].any():
                    raise ValueError(
                        f"{self.name}: no token of the tokenizer continues the output under the grammar (the "
                        "tokenizer cannot spell what the grammar requires next); check that the schema or regex "
                        "fits the tokenizer's vocabulary"
                    )
        return masks

    def _follow(self, row: int, head: Any, tail: Any, committed: int) -> bool:
        """Bring row ``row``'s matcher to the state after the generated tokens ``head + tail`` (the first
        ``committed`` of them committed): whether it holds them all and has not ended."""
        m, fed, cut = self.matchers[row], self.fed[row], len(head)
        size = cut + len(tail)

        def at(i: int) -> int:
            return int(head[i]) if i < cut else int(tail[i - cut])

        same = min(self.stable[row], len(fed), size)
        while same < min(len(fed), size) and fed[same] == at(same):
            same += 1
        if len(fed) > same:
            m.rollback(len(fed) - same)
            del fed[same:]
        ok = True
        for i in range(same, size):
            if m.is_terminated() or not m.accept_token(at(i)):
                ok = False
                break
            fed.append(at(i))
        self.stable[row] = max(self.stable[row], min(committed, len(fed)))
        return ok and not m.is_terminated()
