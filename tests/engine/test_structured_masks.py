"""Structured output's masks (model_service/structured.py) against a brute-force check on the demo vocabulary
(2048 pieces): for a small finite language, a token may be allowed only when the text so far plus its bytes is
still a prefix of some string of the language, and EOS exactly when the text is one of them; and every string
of the language can be generated. (Where the rest of the text is forced, llguidance allows only the tokens of
its tokenization, so a mask may be narrower than the brute-force one: never wider.)"""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from model_service.constraint import Constraint, ConstraintKind
from model_service.sampling_settings import build_mask
from model_service.structured import (
    MAX_CONSTRAINT_CHARS,
    ConstraintError,
    GrammarCompiler,
    Guide,
    Vocabulary,
)
from tests.procs import ROOT

MODEL_VOCAB = 2054  # a model's vocabulary may be padded past the tokenizer's: those ids are never allowed


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    return Vocabulary(str(ROOT / "demo" / "tokenizer.model"))


@pytest.fixture(scope="module")
def compiler(vocabulary: Vocabulary) -> GrammarCompiler:
    return GrammarCompiler(vocabulary, MODEL_VOCAB)


def brute_force(vocabulary: Vocabulary, language: set[bytes], text: bytes) -> np.ndarray:
    """[MODEL_VOCAB] bool: the ids that keep `text` a prefix of a string of `language` (EOS: `text` is one)."""
    out = np.zeros((MODEL_VOCAB,), dtype=bool)
    for i, piece in enumerate(vocabulary.tokens):
        if piece and not piece.startswith(b"\xff"):
            out[i] = any(s.startswith(text + piece) for s in language)
    out[vocabulary.eos_token_id] = text in language
    return out


def assert_within(vocabulary: Vocabulary, mask: np.ndarray, expected: np.ndarray, text: bytes) -> None:
    assert mask.any(), f"after {text!r}: nothing allowed"
    assert not (mask & ~expected).any(), f"after {text!r}: allowed {np.flatnonzero(mask & ~expected)}"
    assert mask[vocabulary.eos_token_id] == expected[vocabulary.eos_token_id], text


def generated(vocabulary: Vocabulary, guide: Guide, text: bytes = b"") -> set[bytes]:
    """Every text the guide lets a sampler produce (depth-first over its masks)."""
    if guide.finished:
        return {text}
    out: set[bytes] = set()
    for token in np.flatnonzero(guide.mask()).tolist():
        if token == vocabulary.eos_token_id:
            out.add(text)
            continue
        branch = Guide(guide._matcher.deep_copy(), guide.vocab_size)
        branch.advance(token)
        out |= generated(vocabulary, branch, text + vocabulary.tokens[token])
    return out


LANGUAGES = [
    (Constraint(ConstraintKind.CHOICE, choices=("yes", "no", "maybe not", "no way")),
     {b"yes", b"no", b"maybe not", b"no way"}),
    (Constraint(ConstraintKind.REGEX, "(ab|cd)[0-9]"),
     {(a + d).encode() for a, d in itertools.product(("ab", "cd"), "0123456789")}),
    (Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"enum": ["a", "bc", 7]})), {b'"a"', b'"bc"', b"7"}),
    # an object as Python's json.dumps writes it (", " and ": ", no other whitespace): what models read most; compact
    # separators made the demo model answer {"answer":": "} where it wrote {"answer": "Yes."} with them
    (Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({
        "type": "object", "properties": {"a": {"enum": [1]}, "b": {"enum": ["x"]}}, "required": ["a", "b"],
        "additionalProperties": False})), {b'{"a": 1, "b": "x"}'}),
    (Constraint(ConstraintKind.GRAMMAR, 'start: "x" ("y" | "zz")'), {b"xy", b"xzz"}),
]


@pytest.mark.parametrize(("constraint", "language"), LANGUAGES, ids=lambda x: getattr(x, "kind", ""))
def test_every_step_mask_equals_the_brute_force_one(vocabulary: Vocabulary, compiler: GrammarCompiler,
                                                    constraint: Constraint, language: set[bytes]) -> None:
    rng = random.Random(0)
    compiled = compiler.compile(constraint)
    assert_within(vocabulary, compiled.first_mask, brute_force(vocabulary, language, b""), b"")
    assert generated(vocabulary, compiled.guide()) == language
    for _ in range(12):  # random paths through the language
        guide, text = compiled.guide(), b""
        while not guide.finished:
            expected = brute_force(vocabulary, language, text)
            assert_within(vocabulary, guide.mask(), expected, text)
            token = rng.choice(np.flatnonzero(expected).tolist())
            guide.advance(token)
            if token == vocabulary.eos_token_id:
                break
            text += vocabulary.tokens[token]
        assert text in language


def test_a_finished_guide_allows_only_eos(vocabulary: Vocabulary, compiler: GrammarCompiler) -> None:
    guide = compiler.compile(Constraint(ConstraintKind.CHOICE, choices=("yes",))).guide()
    for token in vocabulary("yes"):
        guide.advance(token)
    assert guide.finished
    assert np.flatnonzero(guide.mask()).tolist() == [vocabulary.eos_token_id]


def test_a_constraint_compiles_once_and_the_cache_is_bounded(vocabulary: Vocabulary) -> None:
    compiler = GrammarCompiler(vocabulary, MODEL_VOCAB, cache_size=2)
    first = compiler.compile(Constraint(ConstraintKind.REGEX, "a+"))
    assert compiler.compile(Constraint(ConstraintKind.REGEX, "a+")) is first
    compiler.compile(Constraint(ConstraintKind.REGEX, "b+"))
    compiler.compile(Constraint(ConstraintKind.REGEX, "c+"))
    assert compiler.compile(Constraint(ConstraintKind.REGEX, "a+")) is not first  # evicted, compiled again


@pytest.mark.parametrize(("constraint", "field"), [
    (Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2"), "constraint.json_schema"),
    (Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2]"), "constraint.json_schema"),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "nonsense"}'), "constraint.json_schema"),
    (Constraint(ConstraintKind.REGEX, "(a"), "constraint.regex"),
    (Constraint(ConstraintKind.REGEX, ""), "constraint.regex"),
    (Constraint(ConstraintKind.CHOICE, choices=()), "constraint.choice"),
    (Constraint(ConstraintKind.CHOICE, choices=("a", "")), "constraint.choice"),
    (Constraint(ConstraintKind.GRAMMAR, "start: nowhere"), "constraint.grammar"),
    (Constraint(ConstraintKind.GRAMMAR, "root ::= ["), "constraint.grammar"),
    (Constraint(ConstraintKind.REGEX, "a" * (MAX_CONSTRAINT_CHARS + 1)), "constraint.regex"),
])
def test_bad_constraints_name_their_field(compiler: GrammarCompiler, constraint: Constraint, field: str) -> None:
    with pytest.raises(ConstraintError, match=f"^{field}: "):
        compiler.compile(constraint)


def test_a_grammar_over_the_size_limit_is_refused(vocabulary: Vocabulary) -> None:
    small = GrammarCompiler(vocabulary, MODEL_VOCAB, limits=dict(max_grammar_size=100))
    rules = "\n".join(f'r{i}: "a{i}" | "b{i}"' for i in range(60))
    grammar = Constraint(ConstraintKind.GRAMMAR, "start: " + " ".join(f"r{i}" for i in range(60)) + "\n" + rules)
    with pytest.raises(ConstraintError, match="^constraint.grammar: "):
        small.compile(grammar)
    GrammarCompiler(vocabulary, MODEL_VOCAB).compile(grammar)  # within the service's limits


def test_ids_past_the_tokenizer_and_the_requests_own_mask(compiler: GrammarCompiler, vocabulary: Vocabulary) -> None:
    compiled = compiler.compile(Constraint(ConstraintKind.REGEX, "[a-z]+"))
    assert not compiled.first_mask[vocabulary.size:].any()
    base = build_mask(MODEL_VOCAB, 0, (), tuple(np.flatnonzero(compiled.first_mask)[:3].tolist()))
    assert (compiled.first_mask & base).sum() == compiled.first_mask.sum() - 3
