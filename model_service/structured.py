"""Structured output: a request's constraint (JSON schema, regex, choice, grammar) as a per-step token mask.

The grammar engine is llguidance (no PyTorch; Earley parser over a lexer, a token trie for the masks).
`Vocabulary` describes the SentencePiece model to it: each piece's bytes (byte-fallback pieces `<0xNN>`
are that byte, "▁" is a space, control pieces are special and never allowed by a grammar). A
`GrammarCompiler` turns a `Constraint` into a `Compiled` grammar once (a bounded LRU cache keyed by the
constraint); its work is bounded by llguidance's fuel limits and by the size of the constraint, and an
invalid or too-large constraint raises `ConstraintError` naming the request field before a slot is taken.
Each sample of a request gets its own `Guide` (a copy of the compiled matcher): the scheduler advances it
with every drawn token and asks it for the next step's allowed-token mask ([V] bool, host side); the
slot's device mask becomes that mask AND the request's own allowed/blocked/pad mask (`sampling_settings.build_mask`). No JAX here.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import sentencepiece
from llguidance.gbnf_to_lark import any_to_lark

from model_service.constraint import Constraint, ConstraintKind

MAX_CONSTRAINT_CHARS = 64 * 1024  # schema / regex / grammar text, choices together
MAX_CHOICES = 1024
CACHE_SIZE = 64  # compiled constraints kept (LRU)
# llguidance's own limits, lowered from its defaults so that one request's compile stays well under a second.
LIMITS = dict(initial_lexer_fuel=500_000, max_grammar_size=200_000, max_lexer_states=100_000)
# Compact JSON unless the schema's own "x-guidance" says otherwise: a model is not free to pad with whitespace.
JSON_OPTIONS = {"whitespace_flexible": False}
# A serialized NormalizerSpec {add_dummy_prefix: false} as ModelProto field 3: protobuf merges a repeated
# message field into the earlier one, so appending it switches the dummy "▁" prefix off.
_NO_DUMMY_PREFIX = b"\x1a\x02\x18\x00"


class ConstraintError(ValueError):
    """The constraint cannot be served; the message names its field."""


class Vocabulary:
    """The tokenizer as llguidance sees it: every piece's bytes, the EOS id, and encode without a dummy prefix."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            model = f.read()
        self.sp = sentencepiece.SentencePieceProcessor(model_proto=model + _NO_DUMMY_PREFIX)
        self.tokens: list[bytes] = [self._piece_bytes(i) for i in range(self.sp.get_piece_size())]
        self.eos_token_id = self.sp.eos_id()
        self.bos_token_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t.startswith(b"\xff")]
        self.lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(self))

    def _piece_bytes(self, i: int) -> bytes:
        piece = self.sp.id_to_piece(i)
        if self.sp.is_byte(i):
            return bytes([int(piece[3:5], 16)])
        if self.sp.is_control(i) or self.sp.is_unknown(i):
            return b"\xff" + piece.encode()  # llguidance's marker of a special token: never part of any text
        return piece.replace("\u2581", " ").encode()

    def __call__(self, text: bytes | str) -> list[int]:
        """Encode (llguidance's tokenize callback): the ids of exactly these bytes, no leading space added."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.sp.encode(text)

    @property
    def size(self) -> int:
        return len(self.tokens)


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked); ConstraintError on malformed input."""
    size = len(c.text) + sum(len(x) for x in c.choices)
    if size > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(f"{c.field}: {size} characters is over the limit of {MAX_CONSTRAINT_CHARS}")
    if c.kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(c.text)
        except ValueError as e:
            raise ConstraintError(f"{c.field}: not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"{c.field}: a JSON schema is an object (or true/false), not {type(schema).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ConstraintError(f"{c.field}: {e}") from None
    if c.kind is ConstraintKind.REGEX:
        if not c.text:
            raise ConstraintError(f"{c.field}: the regex is empty")
        return llguidance.LLMatcher.grammar_from_regex(c.text)
    if c.kind is ConstraintKind.CHOICE:
        if not c.choices or len(c.choices) > MAX_CHOICES or any(not x for x in c.choices):
            raise ConstraintError(f"{c.field}: give 1..{MAX_CHOICES} non-empty strings")
        # Lark string literals take JSON's escapes, so any choice text is matched literally.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in c.choices))
    if not c.text.strip():
        raise ConstraintError(f"{c.field}: the grammar is empty")
    try:
        lark = any_to_lark(c.text)  # GBNF (llama.cpp's) is converted; Lark passes through
    except Exception as e:  # the converter raises plain exceptions on syntax errors
        raise ConstraintError(f"{c.field}: not a valid GBNF grammar ({e})") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Compiled:
    """One checked grammar: a template matcher (copied per sample) and its first step's mask."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._template = matcher
        self.vocab_size = vocab_size
        self.first_mask = Guide(matcher.deep_copy(), vocab_size).mask()  # [V] bool

    def guide(self) -> Guide:
        return Guide(self._template.deep_copy(), self.vocab_size)


class Guide:
    """One sample's position in its grammar: advance with each drawn token, then ask for the next mask."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def advance(self, token: int) -> None:
        """Take the drawn token (always one the last mask allowed)."""
        if self._matcher.is_stopped():
            return
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar admits no further token (EOS is all it would allow)."""
        return self._matcher.is_stopped()

    def mask(self) -> np.ndarray:
        """[V] bool: the ids the grammar allows next (ids past the tokenizer's vocabulary never)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        if self._matcher.is_error():
            raise RuntimeError(self._matcher.get_error())
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        out = np.zeros((self.vocab_size,), dtype=bool)
        n = min(self.vocab_size, allowed.size)
        out[:n] = allowed[:n]
        return out


class GrammarCompiler:
    """Constraints to compiled grammars over one vocabulary, with a bounded LRU cache (thread-safe)."""

    def __init__(self, vocabulary: Vocabulary, model_vocab_size: int, cache_size: int = CACHE_SIZE,
                 limits: dict[str, int] | None = None) -> None:
        if vocabulary.size > model_vocab_size:
            raise ValueError(f"the tokenizer has {vocabulary.size} pieces, more than the model's vocabulary "
                             f"of {model_vocab_size}")
        self.vocabulary = vocabulary
        self.vocab_size = model_vocab_size
        self.cache_size = cache_size
        self.limits = LIMITS if limits is None else limits
        self._cache: collections.OrderedDict[Constraint, Compiled] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, c: Constraint) -> Compiled:
        """The compiled grammar of `c` (cached); ConstraintError naming the field when it is invalid or too big."""
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                return hit
        compiled = self._compile(c)
        with self._lock:
            self._cache[c] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: Constraint) -> Compiled:
        grammar = grammar_text(c)
        limits = llguidance.LLParserLimits(**self.limits)
        matcher = llguidance.LLMatcher(self.vocabulary.lltokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise ConstraintError(f"{c.field}: {_first_line(matcher.get_error())}")
        compiled = Compiled(matcher, self.vocab_size)
        if not compiled.first_mask.any():
            raise ConstraintError(f"{c.field}: no token of the vocabulary can start the output")
        return compiled




def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid"
