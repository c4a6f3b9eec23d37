"""Grammar-constrained output (``json_schema=`` / ``regex=``) under speculation, on the real SmolLM2 tokenizer.

Tiny Llamas built from configs with the SmolLM2 vocabulary (49,152 ids), so the
grammars compile against a real byte-level BPE tokenizer (marked ``demo_pair``:
the tokenizer comes from the default target's package). Checked, each against
something independent of the loop:

* :class:`GrammarRows` alone, called as the processor chain calls a row
  processor (a drafter's positions, the loop's cut, the target's positions,
  random outcomes): every mask equals a fresh xgrammar matcher's after that
  position's prefix, and every cut is where a fresh matcher refuses the
  proposal (random drafts, many steps);
* the tokens the grammar forces, merged into a row's draft tokens, are a
  fresh matcher's forced continuation (its jump-forward string, or the one
  token its mask allows), on both tokenisations;
* greedy output equals ``target.generate`` with xgrammar's own transformers
  logits processor (plain constrained decoding), at B = 1 and on a ragged
  batch, for the ``model``, ``ngram``, ``hybrid`` and ``eagle`` drafters (and
  a model and a head drafting one token a step), with drafts accepted and
  rejected and forced tokens proposed where a row has room (asserted); also after a repetition penalty and a
  bad-words ban; point-mass proposals (without draft logits, or rows marked
  ``point_mass_rows`` beside them) are cut at their first refused token;
* at T = 0.7, every output over many seeds parses under its schema (or matches
  its regex); negative controls: the same runs without the constraint do not
  all parse, and matchers whose rollback does nothing fail;
* ``output_scores`` carry the mask, ``output_logits`` do not;
* bad arguments, xgrammar's own stateful transformers processor and the JAX
  path raise ``ValueError`` / ``TypeError`` naming the argument.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
import pytest
import torch

import specjax
from specjax.drafters import EagleDrafter, HybridDrafter, ModelDrafter, NgramDrafter, Proposal
from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights
from specjax.generate.grammar import GrammarRows, compile_grammar, grammar_spec
from specjax.generate.row_processors import Prefixes

pytestmark = pytest.mark.demo_pair

V = 49152  # SmolLM2's vocabulary
EOS = 2  # <|im_end|>
G = 4

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        # (a pattern, not maxLength: xgrammar 0.2.9 lets raw control characters into length-bounded
        # strings, which JSON forbids; mlc-ai/xgrammar#800, docs/grammar.md)
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@(mail|post)\.(com|org)"
# prompts whose text holds outputs' pieces, so that n-gram lookups propose them
PROMPTS = {
    "json_schema": (
        '{"name": "Ada", "age": 36, "ok": true, "tags": ["red", "blue"]}\n',
        'Example: {"name": "Bob", "age": 42, "ok": false, "tags": []}. Now:',
        "x",
    ),
    "regex": ("Contacts: ann@mail.com, bob@post.org, cy@mail.org\n", "An address like joe@post.com:", "x"),
}


def conforms(text: str) -> bool:
    """Whether ``text`` is JSON that SCHEMA accepts (a validator written for SCHEMA alone)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "age", "ok", "tags"}
        and isinstance(doc["name"], str)
        and re.fullmatch("[A-Za-z ]{1,8}", doc["name"]) is not None
        and isinstance(doc["age"], int)
        and not isinstance(doc["age"], bool)
        and 0 <= doc["age"] <= 120
        and isinstance(doc["ok"], bool)
        and isinstance(doc["tags"], list)
        and len(doc["tags"]) <= 4
        and all(t in ("red", "green", "blue") for t in doc["tags"])
    )


CONSTRAINTS = {
    "json_schema": ({"json_schema": SCHEMA}, conforms),
    "regex": ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
}


@pytest.fixture(scope="module")
def tok():
    from specjax.pair import load_target

    return load_target()[1]


@pytest.fixture(scope="module")
def models(tiny_lm, perturbed_copy):
    target = tiny_lm("llama", vocab_size=V, layers=2, hidden=32, seed=0)
    return {"target": target, "draft": perturbed_copy(target, noise=0.3, seed=3)}


def prompts(tok, kind: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = [tok.encode(p) for p in PROMPTS[kind][:batch]]
    width = max(map(len, enc))
    ids = torch.tensor([[0] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    return ids, mask


class FewerTokens:
    """``inner`` asked for at most ``most`` tokens a step: room for the tokens the grammar forces after them."""

    def __init__(self, inner: Any, most: int) -> None:
        self.inner, self.most = inner, most
        self.name = f"{inner.name}-{most}"
        self.needs_target_hidden = inner.needs_target_hidden
        self.target_hidden_layers = getattr(inner, "target_hidden_layers", (-1,))
        self.cost_per_token_hint = inner.cost_per_token_hint

    def start(self, setup) -> None:
        self.inner.start(setup)

    def propose(self, request):
        fewer = np.minimum(request.max_tokens, self.most)
        return self.inner.propose(dataclasses.replace(request, max_tokens=fewer, limit=fewer))

    def commit(self, info) -> None:
        self.inner.commit(info)

    def select_rows(self, rows) -> None:
        self.inner.select_rows(rows)


def drafter(kind: str, models) -> Any:
    if kind.endswith("-short"):  # one token a step, G - 1 of room
        return FewerTokens(drafter(kind.removesuffix("-short"), models), 1)
    if kind == "model":
        return ModelDrafter(models["draft"])
    if kind == "ngram":
        return NgramDrafter(min_n=1)
    if kind == "eagle":  # an untrained head (its near-identity start: it drafts, often wrongly)
        head = EagleHead(EagleConfig(models["target"].config.hidden_size, 4, 2, 64, V, 512))
        init_weights(head, 0)
        return EagleDrafter(head.eval())
    return HybridDrafter(NgramDrafter(min_n=1), ModelDrafter(models["draft"]))


def outputs(out, ids, tok) -> list[str]:
    width = ids.shape[1]
    rows = [out.sequences[b, width : width + int(out.num_new_tokens[b])].tolist() for b in range(len(ids))]
    return [tok.decode([t for t in r if t != EOS]) for r in rows]


def compiled(tok, kind: str):
    kwargs = CONSTRAINTS[kind][0]
    return compile_grammar(grammar_spec(**kwargs), tok, V)


# --------------------------------------------------------------------------- #
# GrammarRows against fresh matchers
# --------------------------------------------------------------------------- #


def fresh_matcher(grammar, prefix: list[int]) -> Any:
    """A new matcher fed ``prefix``, or None when the grammar refuses one of its tokens."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(grammar, override_stop_tokens=[EOS])
    return m if all(m.accept_token(int(t)) for t in prefix) else None


def fresh_mask(grammar, prefix: list[int]) -> np.ndarray | None:
    """The bitmask after ``prefix`` from a new matcher (None when the prefix is refused or ended with EOS)."""
    import xgrammar as xgr

    m = fresh_matcher(grammar, prefix)
    if m is None or m.is_terminated():
        return None
    mask = xgr.allocate_token_bitmask(1, V).numpy()
    m.fill_next_token_bitmask(mask)
    return mask[0]


def allowed_ids(mask: np.ndarray) -> np.ndarray:
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]


def row_prefixes(prompt: list[int], prefixes: list[tuple[int, list[int], int]]) -> Prefixes:
    """``(batch row, generated tokens, committed count)`` triples as the processor chain passes them."""
    full = [prompt + gen for _, gen, _ in prefixes]
    width = max(map(len, full))
    ids = np.array([[0] * (width - len(f)) + f for f in full], np.int64)
    return Prefixes(
        np.array([r for r, _, _ in prefixes]),
        ids,
        np.array([len(f) for f in full]),
        np.array([len(prompt) + c for _, _, c in prefixes]),
        len(prompt),
    )


def as_bool(mask: np.ndarray) -> list[bool]:
    return np.unpackbits(mask.view(np.uint8), bitorder="little")[:V].astype(bool).tolist()


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_masks_cuts_and_rollbacks_equal_fresh_matchers(tok, kind):
    """Random drafts mixing valid continuations and arbitrary tokens, called as the processor chain calls a
    row processor (process_rows): a drafter's positions one call each, then the loop's cut of the proposals
    (valid_prefix), then the target's positions of every row in one call, then a random outcome. Each
    proposal is cut where a fresh matcher refuses it; each scores row is masked as a fresh matcher fed its
    prefix's generated tokens masks it."""
    grammar = compiled(tok, kind)
    rng = np.random.default_rng(1)
    batch, prompt = 3, [5, 6, 7]
    rows = GrammarRows(grammar, batch, [EOS], V)
    rows.start(batch, len(prompt))
    committed: list[list[int]] = [[] for _ in range(batch)]
    cut_seen = rolled_back = 0

    def check(calls: list[tuple[int, list[int], int]]) -> None:
        out = rows.process_rows(row_prefixes(prompt, calls), torch.zeros(len(calls), V))
        for n, (_, gen, _) in enumerate(calls):
            expect = fresh_mask(grammar, gen)
            finite = torch.isfinite(out[n]).numpy()
            # refused or ended: never reached, every token allowed
            assert finite.all() if expect is None else finite.tolist() == as_bool(expect)

    for _ in range(12):
        k = rng.integers(0, G + 1, batch)
        drafts: list[list[int]] = [[] for _ in range(batch)]
        for b in range(batch):
            for _ in range(int(k[b])):
                mask = fresh_mask(grammar, committed[b] + drafts[b])
                valid = mask is not None and rng.random() < 0.8
                drafts[b].append(int(rng.choice(allowed_ids(mask))) if valid else int(rng.integers(3, V)))
        for i in range(int(k.max())):  # a drafter: position i of the rows that draft that far
            check([(b, committed[b] + drafts[b][:i], len(committed[b])) for b in range(batch) if k[b] > i])
        rows.begin_step(list(range(batch)), committed)
        tokens = np.zeros((batch, G), np.int64)
        for b in range(batch):
            tokens[b, : k[b]] = drafts[b]
        cut = rows.valid_prefix(tokens, k, np.ones(batch, bool))
        for b in range(batch):
            accepted = [i for i in range(int(k[b]) + 1) if fresh_matcher(grammar, committed[b] + drafts[b][:i])]
            assert cut[b] == max(accepted)
            cut_seen += int(cut[b] < k[b])
        check([(b, committed[b] + drafts[b][:i], len(committed[b])) for b in range(batch) for i in range(cut[b] + 1)])
        for b in range(batch):  # accept n of the valid drafts, then emit a token the grammar allows
            n = int(rng.integers(0, int(cut[b]) + 1))
            rolled_back += int(n < cut[b])
            committed[b] += drafts[b][:n]
            last = fresh_mask(grammar, committed[b])
            if last is not None:
                choices = allowed_ids(last)
                committed[b].append(int(rng.choice(choices[choices != EOS] if len(choices) > 1 else choices)))
    assert cut_seen and rolled_back  # both paths ran


@pytest.mark.parametrize("encode", [True, False], ids=["tokenizer", "xgrammar-tokens"])
@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_forced_tokens_merge_as_a_fresh_matcher_forces(kind, encode, tok):
    """After random valid prefixes, random valid proposals merged with the grammar's forced tokens: a fresh
    matcher fed the committed tokens accepts each new proposal; where it forces text (its jump-forward
    string) or allows one token, the proposal's token spells the start of that text or is that token;
    elsewhere it is the drafter's own; the ``own`` leading tokens are the drafter's and the first token
    after them (if any) is not; at most ``caps`` tokens; rows not asked keep their proposal. The schema's
    fixed keys are forced: forced tokens are proposed."""
    import xgrammar as xgr

    grammar = compiled(tok, kind)
    rng = np.random.default_rng(2)
    batch = 3
    rows = GrammarRows(grammar, batch, [EOS], V, encode=(lambda t: tok.encode(t)) if encode else None)
    rows.start(batch, 0)
    committed: list[list[int]] = [[] for _ in range(batch)]
    forced_seen = 0
    for _ in range(10):
        drafts = []
        for b in range(batch):
            d: list[int] = []
            for _ in range(int(rng.integers(0, 4))):
                mask = fresh_mask(grammar, committed[b] + d)
                if mask is None:
                    break
                d.append(int(rng.choice(allowed_ids(mask))))
            drafts.append(d)
        k = np.array([len(d) for d in drafts], np.int64)
        tokens = np.zeros((batch, max(int(k.max()), 1)), np.int64)
        for b, d in enumerate(drafts):
            tokens[b, : len(d)] = d
        caps = np.maximum(rng.integers(0, 8, batch), k)
        take = np.array([True, True, False])
        rows.begin_step(list(range(batch)), committed)
        out, k2, own = rows.forced_extension(tokens, k, take, caps)
        for b in range(batch):
            new, o = out[b, : k2[b]].tolist(), int(own[b])
            if not take[b]:
                assert (new, o) == (drafts[b], len(drafts[b]))
                continue
            assert len(new) <= caps[b] and new[:o] == drafts[b][:o]
            assert o in (len(new), len(drafts[b])) or new[o] != drafts[b][o]
            forced_seen += len(new) - o
            m = fresh_matcher(grammar, committed[b])
            for i, t in enumerate(new):
                mask = xgr.allocate_token_bitmask(1, V).numpy()
                m.fill_next_token_bitmask(mask)
                forced, only = m.find_jump_forward_string(), allowed_ids(mask[0]).tolist()
                piece = tok.decode([t])
                if forced or len(only) == 1:
                    assert (piece and forced.startswith(piece)) or only == [t], (forced, piece)
                else:
                    assert i < o, "a token the grammar does not force must be the drafter's"
                assert m.accept_token(t)
        for b in range(batch):  # commit some drafts, then a token the grammar allows
            committed[b] += drafts[b][: int(rng.integers(0, len(drafts[b]) + 1))]
            last = fresh_mask(grammar, committed[b])
            if last is not None:
                choices = allowed_ids(last)
                committed[b].append(int(rng.choice(choices[choices != EOS] if len(choices) > 1 else choices)))
    assert forced_seen > 0


@pytest.mark.parametrize("vocab", [64, 49152 + 7])
def test_bitmasks_unpack_to_the_bit_rule_on_both_paths(vocab):
    """Token t is allowed iff bit t % 32 of word t // 32 is set: NumPy's path (CPU) and torch's (accelerators)."""
    from specjax.generate.grammar import _unpack, _unpack_on_device

    rng = np.random.default_rng(0)
    masks = rng.integers(-(2**31), 2**31, size=(3, 2, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    t = np.arange(vocab)
    rule = ((masks[..., t // 32].astype(np.int64) >> (t % 32)) & 1).astype(bool)
    for unpack in (_unpack, _unpack_on_device):
        got = unpack(masks, vocab, torch.device("cpu"))
        assert got.dtype == torch.bool and np.array_equal(got.numpy(), rule)


def test_mask_logits_refuses_exactly_the_masked_ids(tok):
    grammar = compiled(tok, "regex")
    rows = GrammarRows(grammar, 1, [EOS], V)
    masks = fresh_mask(grammar, [])[None, None]
    logits = torch.randn(1, 1, V + 64)  # a head padded beyond the tokenizer
    out = rows.mask_logits(logits, masks)
    allowed = np.unpackbits(masks[0, 0].view(np.uint8), bitorder="little")[:V].astype(bool)
    finite = torch.isfinite(out[0, 0]).numpy()
    assert finite[:V].tolist() == allowed.tolist() and not finite[V:].any()
    assert torch.equal(out[0, 0, :V][torch.as_tensor(allowed)], logits[0, 0, :V][torch.as_tensor(allowed)])
    assert 0 < allowed.sum() < V


# --------------------------------------------------------------------------- #
# Greedy: equal to plain constrained decoding
# --------------------------------------------------------------------------- #


def pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=0)


def plain_constrained(target, ids, mask, grammar, max_new_tokens: int) -> torch.Tensor:
    """transformers' greedy ``generate`` with xgrammar's own logits processor."""
    from xgrammar.contrib.hf import LogitsProcessor

    return target.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        logits_processor=[LogitsProcessor(grammar)],
        eos_token_id=EOS,
        pad_token_id=0,
    )


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind", ["json_schema", "regex"])
@pytest.mark.parametrize("draft_kind", ["model", "ngram", "hybrid", "eagle", "model-short", "eagle-short"])
def test_greedy_matches_plain_constrained_decoding(draft_kind, kind, batch, tok, models):
    ids, mask = prompts(tok, kind, batch)
    target = models["target"]
    ref = plain_constrained(target, ids, mask, compiled(tok, kind), 60)
    out = specjax.speculative_generate(
        target,
        drafter(draft_kind, models),
        ids,
        mask,
        max_new_tokens=60,
        num_draft_tokens=G,
        eos_token_id=EOS,
        pad_token_id=0,
        target_tokenizer=tok,
        adaptive=False,
        **CONSTRAINTS[kind][0],
    )
    # both pad finished rows with 0 (after their EOS)
    new, expect = out.sequences[:, ids.shape[1] :], ref[:, ids.shape[1] :]
    length = max(new.shape[1], expect.shape[1])
    assert torch.equal(pad_to(new, length), pad_to(expect, length))
    assert all(CONSTRAINTS[kind][1](text) for text in outputs(out, ids, tok))
    # the drafter's own drafts (not the grammar's forced tokens) were tested and some rejected (the
    # rollback ran), and some accepted (n-gram lookups on the regex prompts find the random target's
    # choices too rarely for that)
    s = out.stats
    own_proposed = s.draft_tokens_proposed - s.forced_tokens_proposed
    own_accepted = s.draft_tokens_accepted - s.forced_tokens_accepted
    assert own_accepted < own_proposed or (draft_kind, kind) == ("ngram", "regex")
    assert own_accepted > 0 or (draft_kind, kind) in (("ngram", "regex"), ("eagle", "regex"))
    # the tokens the grammar forces (keys, punctuation; "@", "." in the regex) were proposed besides
    # wherever a row had room (a model or head asked for G tokens a step drafts them all), and the
    # schema's accepted (the regex's short outputs see them rejected after a rejected draft token)
    if draft_kind not in ("model", "eagle"):
        assert s.forced_tokens_proposed > 0 and (s.forced_tokens_accepted > 0 or kind == "regex")


@pytest.mark.parametrize("draft_kind", ["model", "hybrid"])
def test_greedy_with_other_processors_matches_generate(draft_kind, tok, models):
    """A grammar after a repetition penalty and a bad-words ban, as generate orders a custom processor."""
    from xgrammar.contrib.hf import LogitsProcessor

    ids, mask = prompts(tok, "json_schema", 3)
    target, banned = models["target"], [[tok.encode(" true")[0]]]
    ref = target.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=60,
        repetition_penalty=1.3,
        bad_words_ids=banned,
        logits_processor=[LogitsProcessor(compiled(tok, "json_schema"))],
        eos_token_id=EOS,
        pad_token_id=0,
    )
    out = specjax.speculative_generate(
        target,
        drafter(draft_kind, models),
        ids,
        mask,
        max_new_tokens=60,
        eos_token_id=EOS,
        pad_token_id=0,
        target_tokenizer=tok,
        adaptive=False,
        repetition_penalty=1.3,
        bad_words_ids=banned,
        json_schema=SCHEMA,
    )
    new, expect = out.sequences[:, ids.shape[1] :], ref[:, ids.shape[1] :]
    length = max(new.shape[1], expect.shape[1])
    assert torch.equal(pad_to(new, length), pad_to(expect, length))
    assert all(conforms(t) for t in outputs(out, ids, tok))


class CorruptingOracle:
    """Proposes the reference continuation with its third token replaced by one the grammar refuses
    (point masses): the loop must cut each proposal to its first two tokens.

    ``marked``: the proposal carries draft logits (never read) and marks its row as a point mass
    (``Proposal.point_mass_rows``), as the hybrid drafter marks its n-gram rows; else no logits.
    """

    name = "oracle"
    needs_target_hidden = False
    cost_per_token_hint = 0.0

    def __init__(self, reference: list[int], prompt_len: int, grammar, marked: bool = False) -> None:
        self.reference, self.prompt_len, self.grammar, self.marked = reference, prompt_len, grammar, marked

    def start(self, setup) -> None:
        pass

    def propose(self, request):
        ctx = request.contexts[0]
        done = len(ctx) - self.prompt_len
        want = self.reference[done : done + int(request.allowed[0])]
        if len(want) > 2:
            # a token the grammar refuses after the reference's first two
            want[2] = next(
                t for t in range(100, V) if fresh_matcher(self.grammar, [*self.reference[: done + 2], t]) is None
            )
        tokens = np.zeros((1, max(len(want), 1)), np.int32)
        tokens[0, : len(want)] = want
        if self.marked:
            logits = tuple(torch.zeros(1, V) for _ in range(tokens.shape[1]))
            return Proposal(
                tokens, np.array([len(want)], np.int64), logits, paid_tokens=0, point_mass_rows=np.array([True])
            )
        return Proposal(tokens, np.array([len(want)], np.int64), None, paid_tokens=0)

    def commit(self, info) -> None:
        pass

    def select_rows(self, rows) -> None:
        pass


@pytest.mark.parametrize("marked", [False, True], ids=["no-logits", "point-mass-rows"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_point_mass_proposals_are_cut_at_their_first_refused_token(temperature, marked, tok, models):
    ids, mask = prompts(tok, "json_schema", 1)
    grammar = compiled(tok, "json_schema")
    target = models["target"]
    ref = plain_constrained(target, ids, mask, grammar, 40)[0, ids.shape[1] :].tolist()
    out = specjax.speculative_generate(
        target,
        CorruptingOracle(ref, ids.shape[1], grammar, marked),
        ids,
        mask,
        max_new_tokens=40,
        num_draft_tokens=G,
        temperature=temperature,
        eos_token_id=EOS,
        pad_token_id=0,
        target_tokenizer=tok,
        adaptive=False,
        json_schema=SCHEMA,
    )
    if temperature == 0:
        assert out.sequences[0, ids.shape[1] :].tolist() == ref
    # only the two valid tokens of each proposal were tested (and, greedy, all accepted), besides the
    # tokens the grammar forced after them
    s = out.stats
    own_proposed = s.draft_tokens_proposed - s.forced_tokens_proposed
    assert 0 < own_proposed <= 2 * s.draft_steps
    assert temperature or s.draft_tokens_accepted - s.forced_tokens_accepted == own_proposed


def test_output_scores_carry_the_mask_and_output_logits_do_not(tok, models):
    """As ``generate``: scores are processed (the grammar's ``-inf`` included), logits are the target's own."""
    ids, mask = prompts(tok, "json_schema", 1)
    out = specjax.speculative_generate(
        models["target"],
        "ngram",
        ids,
        mask,
        max_new_tokens=12,
        eos_token_id=EOS,
        target_tokenizer=tok,
        json_schema=SCHEMA,
        output_scores=True,
        output_logits=True,
    )
    grammar = compiled(tok, "json_schema")
    new = out.sequences[0, ids.shape[1] :].tolist()
    for i, (scores, logits) in enumerate(zip(out.scores, out.logits, strict=True)):
        allowed = np.unpackbits(fresh_mask(grammar, new[:i]).view(np.uint8), bitorder="little")[:V].astype(bool)
        assert torch.isfinite(scores[0]).numpy().tolist() == allowed.tolist()
        assert torch.isfinite(logits[0]).all()


# --------------------------------------------------------------------------- #
# Sampled: every output valid; negative controls
# --------------------------------------------------------------------------- #


def sampled_texts(models, tok, kind: str, draft_kind: str, seeds: range, constrained: bool = True) -> list[str]:
    ids, mask = prompts(tok, kind, 3)
    texts = []
    for seed in seeds:
        out = specjax.speculative_generate(
            models["target"],
            drafter(draft_kind, models),
            ids,
            mask,
            max_new_tokens=60,
            num_draft_tokens=G,
            temperature=0.7,
            seed=seed,
            eos_token_id=EOS,
            pad_token_id=0,
            target_tokenizer=tok,
            **(CONSTRAINTS[kind][0] if constrained else {}),
        )
        texts += outputs(out, ids, tok)
    return texts


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
@pytest.mark.parametrize("draft_kind", ["model", "ngram", "hybrid", "model-short"])
def test_every_sampled_output_is_valid(draft_kind, kind, tok, models):
    texts = sampled_texts(models, tok, kind, draft_kind, range(8))
    bad = [t for t in texts if not CONSTRAINTS[kind][1](t)]
    assert not bad, bad[:3]
    assert len(set(texts)) > len(texts) // 2  # sampled: the outputs vary


def test_negative_control_unconstrained_outputs_do_not_parse(tok, models):
    texts = sampled_texts(models, tok, "json_schema", "model", range(2), constrained=False)
    assert not any(conforms(t) for t in texts)


def test_negative_control_a_matcher_that_does_not_roll_back_fails(tok, models, monkeypatch):
    """Matchers whose rollback does nothing keep rejected draft tokens: the run fails or its outputs do not parse."""
    import xgrammar as xgr

    monkeypatch.setattr(xgr.GrammarMatcher, "rollback", lambda self, num_tokens=1: None)
    try:
        texts = sampled_texts(models, tok, "json_schema", "model", range(4))
    except ValueError:
        return
    assert not all(conforms(t) for t in texts)


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"json_schema": SCHEMA, "regex": "a"}, ValueError, "json_schema, regex: expected at most one"),
        ({"json_schema": "{not json"}, ValueError, "json_schema: expected a JSON schema, got text that is not JSON"),
        ({"json_schema": [1]}, ValueError, "json_schema: expected a JSON schema .* got list"),
        ({"json_schema": 3.5}, ValueError, "json_schema: expected a JSON schema .* got float"),
        ({"json_schema": {"type": "nonsense"}}, ValueError, "json_schema: xgrammar cannot compile it: .*nonsense"),
        ({"regex": "[a-"}, ValueError, "regex: xgrammar cannot compile it"),
        ({"regex": ""}, ValueError, "regex: expected a non-empty regular expression"),
        ({"regex": 5}, TypeError, "regex: expected a regular expression"),
        ({"regex": "a", "target_tokenizer": None}, ValueError, "target_tokenizer: regex needs the target's tokenizer"),
        ({"regex": "a", "eos_token_id": []}, ValueError, "eos_token_id: regex needs an EOS token id"),
    ],
)
def test_bad_constraints_are_refused(kwargs, error, message, tok, models):
    ids, mask = prompts(tok, "regex", 1)
    call = {"eos_token_id": EOS, "target_tokenizer": tok, **kwargs}
    with pytest.raises(error, match=message):
        specjax.speculative_generate(models["target"], "ngram", ids, mask, max_new_tokens=4, **call)


def test_xgrammars_own_transformers_processor_is_refused_with_the_way_out(tok, models):
    """It keeps matcher state from call to call (the loop calls processors on drafts): a clear error, not an
    assertion deep inside xgrammar."""
    from xgrammar.contrib.hf import LogitsProcessor

    ids, mask = prompts(tok, "json_schema", 1)
    with pytest.raises(ValueError, match=r"logits_processor: item 0, LogitsProcessor, .*pass json_schema= or regex="):
        specjax.speculative_generate(
            models["target"],
            "ngram",
            ids,
            mask,
            max_new_tokens=4,
            eos_token_id=EOS,
            logits_processor=[LogitsProcessor(compiled(tok, "json_schema"))],
        )


@pytest.mark.torchax  # imports torchax: its own session (make test-torchax)
def test_the_jax_path_refuses_a_grammar_by_its_name(tok, models):
    """Models on torchax's jax device run the JAX loop, which has no processors yet: refused, naming the argument."""
    import copy

    import torchax

    target = copy.deepcopy(models["target"])
    with torchax.default_env():
        target.to("jax")
    ids, mask = prompts(tok, "regex", 1)
    for kwargs in ({"json_schema": SCHEMA}, {"regex": REGEX}):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"{name}: not supported yet on the JAX path"):
            specjax.speculative_generate(
                target, "ngram", ids, mask, max_new_tokens=4, eos_token_id=EOS, target_tokenizer=tok, **kwargs
            )


def test_a_pydantic_model_gives_its_schema():
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    spec = grammar_spec(json_schema=Person)
    assert spec is not None and json.loads(spec.source) == Person.model_json_schema()
