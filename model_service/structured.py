"""Structured output: a request's constraint (JSON schema, regex, choice, grammar) as a per-step token mask.

The grammar engine is llguidance (no PyTorch; Earley parser over a lexer, a token trie for the masks).
`Vocabulary` describes the SentencePiece model to it: each piece's bytes (byte-fallback pieces `<0xNN>`
are that byte, "▁" is a space, control pieces are special and never allowed by a grammar).

A `GrammarCompiler` turns a `Constraint` into a `Compiled` grammar once (bounded LRU caches of grammars and
of refusals, keyed by the constraint). Nothing of an unchecked constraint runs in the service's process:
`checked_grammar` (the size bounds of constraint.py, the conversion to llguidance's grammar, the compile, the
first mask and a few steps along it) runs in a worker process (grammar_pool.py), so a crash or a runaway
compile in the library costs that worker and that request only (INVALID_ARGUMENT naming the field), and
another compile never waits on the event loop or the decode thread. The service then builds the matcher of
the checked grammar, which the worker just built within the time limit, in a compile thread
(`compile_async`; llguidance releases the GIL while it compiles).

Each sample of a request gets its own `Guide` (a copy of the compiled matcher): the scheduler advances it
with every drawn token and asks it for the next step's allowed-token mask ([V] bool, host side); the
slot's device mask becomes that mask AND the request's own allowed/blocked/pad mask (guided.py). A
per-step limit of the library raises `StepLimit`, which ends that request only. No JAX here.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import sys
import threading
from typing import Any

import llguidance
import numpy as np
import sentencepiece
from llguidance.gbnf_to_lark import any_to_lark

from model_service.constraint import BOUNDS, Bounds, Constraint, ConstraintKind, size_problem
from model_service.grammar_pool import PoolBusy, WorkerCrashed, WorkerPool, WorkerTimeout, WorkerUnavailable
from serving_common.limits import CONSTRAINT_COMPILE_SECONDS, MAX_CONSTRAINT_CHARS

__all__ = ["MAX_CONSTRAINT_CHARS", "CompilerBusy", "CompilerUnavailable", "Compiled", "ConstraintError",
           "GrammarCompiler", "Guide", "StepLimit", "Vocabulary", "checked_grammar", "grammar_text"]

CACHE_SIZE = 64  # compiled constraints kept (LRU); as many refusals again
WORKERS = 2  # compile worker processes
# llguidance's own limits, lowered from its defaults so that one request's compile stays well under a second;
# non-verbose errors: the library's message without its parser state or the grammar's text.
LIMITS: dict[str, Any] = dict(initial_lexer_fuel=500_000, max_grammar_size=200_000, max_lexer_states=100_000,
                              verbose_errors=False)
PROBE_STEPS = 4  # steps `checked_grammar` takes along the first allowed tokens, so a grammar the library gives
#                  up on at once (per-step limits, e.g. `start: "a" start`) is refused before a slot is taken
# JSON as Python's json.dumps writes it, ", " and ": " and no other whitespace, unless the schema's own "x-guidance"
# says otherwise: what models have read most (compact separators made the demo model answer {"answer":": "} where
# it writes {"answer": "Yes."}), and no freedom to pad with whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A serialized NormalizerSpec {add_dummy_prefix: false} as ModelProto field 3: protobuf merges a repeated
# message field into the earlier one, so appending it switches the dummy "▁" prefix off.
_NO_DUMMY_PREFIX = b"\x1a\x02\x18\x00"
# llguidance's word for a grammar no text can satisfy (an empty first mask).
_NO_TEXT = "NoExtensionBias"


class ConstraintError(ValueError):
    """The constraint cannot be served; the message names its field (INVALID_ARGUMENT)."""


class CompilerBusy(Exception):
    """Too many constraints are waiting for a compile worker (RESOURCE_EXHAUSTED: retry later)."""


class CompilerUnavailable(Exception):
    """No compile worker can be started (UNAVAILABLE: the service's fault, not the request's)."""


class StepLimit(RuntimeError):
    """The library gave up computing the next step of an allowed path (one of its per-step limits)."""


class Vocabulary:
    """The tokenizer as llguidance sees it: every piece's bytes, the EOS id, and encode without a dummy prefix."""

    def __init__(self, path: str) -> None:
        self.path = path
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


def grammar_text(c: Constraint, bounds: Bounds = BOUNDS) -> str:
    """The llguidance grammar of a constraint (not yet compiled); ConstraintError on malformed or too big input."""
    problem = size_problem(c, bounds)
    if problem:
        raise ConstraintError(problem)
    if c.kind is ConstraintKind.JSON_SCHEMA:
        return _schema_grammar(c)
    if c.kind is ConstraintKind.REGEX:
        if not c.text:
            raise ConstraintError(f"{c.field}: the regex is empty")
        return llguidance.LLMatcher.grammar_from_regex(c.text)
    if c.kind is ConstraintKind.CHOICE:
        # Lark string literals take JSON's escapes, so any choice text is matched literally.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in c.choices))
    if not c.text.strip():
        raise ConstraintError(f"{c.field}: the grammar is empty")
    try:
        lark = any_to_lark(c.text)  # GBNF (llama.cpp's) is converted; Lark passes through
    except RecursionError:
        raise ConstraintError(f"{c.field}: nested too deeply to convert; flatten the grammar") from None
    except Exception as e:  # the converter raises plain exceptions on syntax errors
        raise ConstraintError(f"{c.field}: not a valid GBNF grammar ({e})") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _schema_grammar(c: Constraint) -> str:
    try:
        schema = json.loads(c.text)
    except RecursionError:  # size_problem bounds the depth first; this stays a 400 whatever the bound
        raise ConstraintError(f"{c.field}: nested too deeply; flatten the schema") from None
    except ValueError as e:
        raise ConstraintError(f"{c.field}: not valid JSON ({e})") from None
    if schema is True:
        schema = {}  # JSON Schema's `true`: any JSON value, as {}
    elif schema is False:
        raise ConstraintError(f"{c.field}: the schema false matches no JSON value; send a schema some value meets")
    if not isinstance(schema, dict):
        raise ConstraintError(f"{c.field}: a JSON schema is an object (or true), not {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, RecursionError) as e:
        raise ConstraintError(f"{c.field}: {_first_line(str(e))}") from None


def _matcher(vocabulary: Vocabulary, grammar: str, limits: dict[str, Any], field: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(vocabulary.lltokenizer, grammar, log_level=0,
                                   limits=llguidance.LLParserLimits(**limits))
    if matcher.is_error():
        raise ConstraintError(f"{field}: {_library_message(matcher.get_error())}")
    return matcher


def checked_grammar(vocabulary: Vocabulary, c: Constraint, limits: dict[str, Any] = LIMITS,
                    bounds: Bounds = BOUNDS) -> str:
    """Everything that can go wrong with `c` before a slot is taken (run in a worker process): its grammar,
    compiled, with a first mask that allows something, followed PROBE_STEPS tokens along its first allowed
    ones without the library giving up. Returns the grammar; ConstraintError naming the field otherwise."""
    grammar = grammar_text(c, bounds)
    guide = Guide(_matcher(vocabulary, grammar, limits, c.field), vocabulary.size)
    for step in range(PROBE_STEPS + 1):
        try:
            mask = guide.mask()
        except StepLimit as e:
            raise ConstraintError(_failed(c.field, str(e), step)) from None
        allowed = [t for t in np.flatnonzero(mask).tolist() if t != vocabulary.eos_token_id]
        if not mask.any():
            raise ConstraintError(f"{c.field}: no token of the vocabulary can start the output" if step == 0 else
                                  f"{c.field}: no token can continue the output after token {step}")
        if guide.finished or not allowed or step == PROBE_STEPS:
            return grammar
        try:
            guide.advance(allowed[0])
        except StepLimit as e:
            raise ConstraintError(_failed(c.field, str(e), step + 1)) from None
    return grammar


def _failed(field: str, message: str, step: int) -> str:
    if message == _NO_TEXT and step == 0:
        return (f"{field}: no text can satisfy it (a $ref to itself or a cycle of $refs, a rule that only "
                "refers to itself, or an empty character class); send a constraint some text meets")
    if message == _NO_TEXT:
        return f"{field}: no text can continue the output after token {step}; send a constraint some text meets"
    return f"{field}: too complex to follow at token {step} ({message}); simplify the constraint"


class Compiled:
    """One checked grammar: a template matcher (copied per sample) and its first step's mask."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._template = matcher
        self.vocab_size = vocab_size
        self.first_mask = Guide(matcher.deep_copy(), vocab_size).mask()  # [V] bool

    def guide(self) -> Guide:
        return Guide(self._template.deep_copy(), self.vocab_size, self.first_mask)


class Guide:
    """One sample's position in its grammar: advance with each drawn token, then ask for the next mask."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, allowed: np.ndarray | None = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._allowed = allowed  # [V] bool: the last mask, what the next drawn token was chosen within

    def advance(self, token: int) -> None:
        """Take the drawn token. StepLimit when the library gives up on a token its last mask allowed;
        RuntimeError for one it did not allow (the sampler broke its mask: a bug)."""
        if self._matcher.is_stopped():
            return
        if self._matcher.consume_token(token):
            return
        message = _library_message(self._matcher.get_error())
        if self._allowed is not None and 0 <= token < self._allowed.size and self._allowed[token]:
            raise StepLimit(message)
        raise RuntimeError(f"the grammar rejected token {token}: {message}")

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar admits no further token (EOS is all it would allow)."""
        return self._matcher.is_stopped()

    def mask(self) -> np.ndarray:
        """[V] bool: the ids the grammar allows next (ids past the tokenizer's vocabulary never); StepLimit
        when the library cannot compute it."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        if self._matcher.is_error():
            raise StepLimit(_library_message(self._matcher.get_error()))
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        out = np.zeros((self.vocab_size,), dtype=bool)
        n = min(self.vocab_size, allowed.size)
        out[:n] = allowed[:n]
        self._allowed = out
        return out


class GrammarCompiler:
    """Constraints to compiled grammars over one vocabulary: checked in worker processes, cached (thread-safe).

    `compile_async` is what the servicer awaits before it submits a request (off the event loop, off the
    decode thread); `compile` is the same, blocking the calling thread. `close()` ends the workers."""

    def __init__(self, vocabulary: Vocabulary, model_vocab_size: int, cache_size: int = CACHE_SIZE,
                 limits: dict[str, Any] | None = None, bounds: Bounds = BOUNDS, workers: int = WORKERS,
                 compile_seconds: float = CONSTRAINT_COMPILE_SECONDS, worker_command: list[str] | None = None,
                 max_waiting: int = 64) -> None:
        if vocabulary.size > model_vocab_size:
            raise ValueError(f"the tokenizer has {vocabulary.size} pieces, more than the model's vocabulary "
                             f"of {model_vocab_size}")
        self.vocabulary = vocabulary
        self.vocab_size = model_vocab_size
        self.cache_size = cache_size
        self.limits = dict(LIMITS if limits is None else limits)
        self.bounds = bounds
        self.compile_seconds = compile_seconds
        command = worker_command or [sys.executable, "-m", "model_service.grammar_worker", vocabulary.path,
                                     json.dumps({"limits": self.limits, "bounds": bounds.__dict__})]
        self.max_waiting = max_waiting
        self._pending = 0  # compile_async calls not answered yet
        self.pool = WorkerPool(command, workers, compile_seconds, max_waiting)
        # Threads that wait on the workers and build the checked matchers: one per worker, plus cache hits.
        self._threads = concurrent.futures.ThreadPoolExecutor(workers + 1, thread_name_prefix="grammar")
        self._cache: collections.OrderedDict[Constraint, Compiled] = collections.OrderedDict()
        self._refused: collections.OrderedDict[Constraint, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def start(self, wait: bool = False) -> None:
        """Start the worker processes now (else the first constraint does); with `wait`, until they are ready."""
        self.pool.start(wait)

    def close(self) -> None:
        self.pool.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def compile_async(self, c: Constraint) -> Compiled:
        """`compile` on a compile thread: the event loop keeps serving while the constraint compiles (a cached
        one is answered at once). CompilerBusy when `max_waiting` compiles are already pending."""
        hit = self._cached(c)
        if hit is not None:
            return hit
        with self._lock:
            if self._pending >= self.max_waiting:
                raise CompilerBusy("too many structured-output constraints are waiting to compile; retry later")
            self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, self.compile, c)
        finally:
            with self._lock:
                self._pending -= 1

    def _cached(self, c: Constraint) -> Compiled | None:
        """The cached grammar of `c`, None when there is none; ConstraintError when `c` was refused before."""
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                return hit
            refused = self._refused.get(c)
        if refused is not None:
            raise ConstraintError(refused)
        return None

    def compile(self, c: Constraint) -> Compiled:
        """The compiled grammar of `c` (cached). ConstraintError naming the field when it is invalid, too big,
        too slow to compile (CONSTRAINT_COMPILE_SECONDS) or crashes the library; CompilerBusy when too many
        constraints wait for a worker."""
        hit = self._cached(c)
        if hit is not None:
            return hit
        try:
            compiled = self._compile(c)
        except _Uncached:
            raise
        except ConstraintError as e:
            self._remember(self._refused, c, str(e))
            raise
        self._remember(self._cache, c, compiled)
        return compiled

    def _remember(self, cache: collections.OrderedDict[Constraint, Any], c: Constraint, value: Any) -> None:
        with self._lock:
            cache[c] = value
            cache.move_to_end(c)
            while len(cache) > self.cache_size:
                cache.popitem(last=False)

    def _compile(self, c: Constraint) -> Compiled:
        problem = size_problem(c, self.bounds)  # cheap, and saves a worker round trip
        if problem:
            raise ConstraintError(problem)
        payload = {"kind": c.kind.value, "text": c.text, "choices": list(c.choices)}
        try:
            reply = self.pool.run(payload)
        except PoolBusy:
            raise CompilerBusy("too many structured-output constraints are waiting to compile; retry later") from None
        except WorkerUnavailable as e:
            raise CompilerUnavailable(f"structured output is unavailable: {e}; retry later") from None
        except WorkerTimeout:
            raise _Uncached(f"{c.field}: took longer than {self.compile_seconds:g} s to compile; simplify the "
                            "constraint") from None
        except WorkerCrashed as e:
            raise ConstraintError(f"{c.field}: the grammar library failed on it ({e}); simplify the "
                                  "constraint") from None
        if "error" in reply:
            raise ConstraintError(str(reply["error"]))
        try:  # the worker compiled exactly this within the limits: this is the same work, in this process
            compiled = Compiled(_matcher(self.vocabulary, reply["grammar"], self.limits, c.field), self.vocab_size)
        except StepLimit as e:
            raise ConstraintError(_failed(c.field, str(e), 0)) from None
        if not compiled.first_mask.any():
            raise ConstraintError(f"{c.field}: no token of the model's vocabulary can start the output")
        return compiled


class _Uncached(ConstraintError):
    """A refusal that depends on the load (a compile timeout): not remembered."""


def _library_message(message: str) -> str:
    """The library's error, its first line only (the rest, if any, is parser state)."""
    return _first_line(message)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid"
