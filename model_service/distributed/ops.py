"""The lockstep op table: every Engine call process 0 makes, as an op code plus fixed-shape int32 arrays.

A multi-process replica runs the same compiled programs on every process in the same order. Process 0
decides what runs (the scheduler drives it); before each Engine call it broadcasts the call (`Codec.encode`)
and then every process, itself included, executes the decoded call on its own `Replica` (`Replica.run`).
Because both sides execute the *decoded* call, their engines receive identical arguments by construction.

This module is the only place that knows the Engine's host API. When that API changes, add or change an
`Op`, its fields in `Call`/`Codec`, its line in `Replica.run`, and the method of `LockstepEngine` that
issues it (lockstep.py).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from model_service.sampling_settings import GREEDY, MAX_LOGIT_BIAS, SamplingSettings

log = logging.getLogger(__name__)


class Op(enum.IntEnum):
    NOOP = 0  # keep-alive: proves every process still follows, and releases prefixes
    SHUTDOWN = 1  # process 0 is stopping cleanly; followers leave their loop
    COMPILE_ALL = 2  # Engine.compile_all()
    INIT = 3  # Engine.init_decode_state()
    PREFILL = 4  # Engine.prefill(prompt, sampling, seed=, prompt_logprobs=) -> `prefix`
    INSERT = 5  # Engine.insert(prefix `prefix`, state, slot)
    GENERATE = 6  # Engine.generate(state)
    FREE = 7  # Engine.free_slot(state, slot)
    BEGIN_PREFILL = 8  # Engine.begin_prefill(prompt, sampling, slot=, seed=) -> job kept under id `prefix`
    PREFILL_CHUNK = 9  # Engine.prefill_next_chunk(job `prefix`, state)
    RESAMPLE = 10  # Engine.resample(prefix `source`, seed=) -> a new prefix kept under id `prefix` (n > 1)


class Field(enum.IntEnum):
    """Positions in the int32 header."""

    OP = 0
    SEQ = 1  # call number: a follower that sees a gap has diverged
    RELEASE_BELOW = 2  # prefixes with a smaller id are no longer referenced on process 0
    SLOT = 3
    PREFIX = 4
    LENGTH = 5  # prompt length
    SEED = 6  # uint32 bits
    TEMPERATURE = 7  # float32 bits (sampling.temperature)
    TOP_P = 8  # float32 bits (sampling.top_p)
    TOP_LOGPROBS = 9  # sampling.top_logprobs
    SOURCE = 10  # RESAMPLE: the prefix it draws from
    PROMPT_LOGPROBS = 11  # PREFILL: -1 for none


HEADER_SIZE = 12


@dataclass(frozen=True)
class Call:
    """One Engine call with every argument it takes (floats are float32 values, as broadcast)."""

    op: Op
    seq: int = 0
    release_below: int = 0
    slot: int = 0
    prefix: int = 0
    prompt: tuple[int, ...] = ()
    seed: int = 0
    sampling: SamplingSettings = GREEDY  # the request's settings, as the engine takes them
    source: int = 0
    prompt_logprobs: int | None = None


CONTROL_WORDS = 6 + 2 * MAX_LOGIT_BIAS  # top_k, 4 float32 controls, bias count, bias ids, bias values


def _f32_bits(x: float) -> int:
    return int(np.array(x, np.float32).view(np.int32))


def _bits_f32(bits: int) -> float:
    return float(np.array(bits, np.int32).view(np.float32))


class Codec:
    """Calls as fixed-shape int32 arrays (a collective needs the same shapes on every process).

    Every call is a header [HEADER_SIZE], which holds the settings' temperature, top_p and top_logprobs; PREFILL
    and BEGIN_PREFILL add a payload: the prompt padded to `max_prompt`, the settings' allowed and blocked token sets
    as two bitmaps over the vocabulary, and their controls [CONTROL_WORDS] (floats as their float32 bits).
    """

    def __init__(self, max_prompt: int, vocab_size: int) -> None:
        self.max_prompt = max_prompt
        self.vocab_size = vocab_size
        self.bitmap_words = -(-vocab_size // 32)

    @staticmethod
    def has_payload(op: Op) -> bool:
        return op in (Op.PREFILL, Op.BEGIN_PREFILL)

    def empty_header(self) -> np.ndarray:
        return np.zeros((HEADER_SIZE,), np.int32)

    def empty_payload(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.zeros((self.max_prompt,), np.int32), np.zeros((2, self.bitmap_words), np.int32),
                np.zeros((CONTROL_WORDS,), np.int32))

    def header(self, call: Call) -> np.ndarray:
        h = self.empty_header()
        values = {Field.OP: int(call.op), Field.SEQ: call.seq, Field.RELEASE_BELOW: call.release_below,
                  Field.SLOT: call.slot, Field.PREFIX: call.prefix, Field.LENGTH: len(call.prompt),
                  Field.SEED: int(np.array(call.seed, np.uint32).view(np.int32)),
                  Field.TEMPERATURE: _f32_bits(call.sampling.temperature),
                  Field.TOP_P: _f32_bits(call.sampling.top_p),
                  Field.TOP_LOGPROBS: call.sampling.top_logprobs, Field.SOURCE: call.source,
                  Field.PROMPT_LOGPROBS: -1 if call.prompt_logprobs is None else call.prompt_logprobs}
        for field, value in values.items():
            h[field] = value
        return h

    def payload(self, call: Call) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(call.prompt) > self.max_prompt:
            raise ValueError(f"prompt of {len(call.prompt)} tokens exceeds the largest prefill bucket {self.max_prompt}")
        c, n = call.sampling, len(call.sampling.logit_bias)
        if n > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {n} entries; at most {MAX_LOGIT_BIAS}")
        tokens, bitmaps, words = self.empty_payload()
        tokens[:len(call.prompt)] = call.prompt
        bitmaps[0] = self._bitmap(c.allowed)
        bitmaps[1] = self._bitmap(c.blocked)
        words[:6] = [c.top_k, _f32_bits(c.min_p), _f32_bits(c.repetition_penalty), _f32_bits(c.presence_penalty),
                     _f32_bits(c.frequency_penalty), n]
        for i, (token, bias) in enumerate(c.logit_bias):
            words[6 + i], words[6 + MAX_LOGIT_BIAS + i] = token, _f32_bits(bias)
        return tokens, bitmaps, words

    def decode(self, header: np.ndarray, payload: Sequence[np.ndarray] | None) -> Call:
        op = Op(int(header[Field.OP]))
        sampling = SamplingSettings(temperature=_bits_f32(int(header[Field.TEMPERATURE])),
                                    top_p=_bits_f32(int(header[Field.TOP_P])),
                                    top_logprobs=int(header[Field.TOP_LOGPROBS]))
        prompt: tuple[int, ...] = ()
        if payload is not None:
            tokens, bitmaps, words = payload
            prompt = tuple(int(t) for t in tokens[:int(header[Field.LENGTH])])
            sampling = _with_payload(sampling, self._ids(bitmaps[0]), self._ids(bitmaps[1]), words)
        return Call(op=op, seq=int(header[Field.SEQ]), release_below=int(header[Field.RELEASE_BELOW]),
                    slot=int(header[Field.SLOT]), prefix=int(header[Field.PREFIX]), prompt=prompt,
                    seed=int(np.array(header[Field.SEED], np.int32).view(np.uint32)), sampling=sampling,
                    source=int(header[Field.SOURCE]),
                    prompt_logprobs=None if header[Field.PROMPT_LOGPROBS] < 0 else int(header[Field.PROMPT_LOGPROBS]))

    def _bitmap(self, ids: Sequence[int]) -> np.ndarray:
        mask = np.zeros((self.bitmap_words * 32,), bool)
        mask[np.asarray(ids, np.int64)] = True
        return np.packbits(mask, bitorder="little").view("<i4")

    def _ids(self, words: np.ndarray) -> tuple[int, ...]:
        bits = np.unpackbits(np.ascontiguousarray(words, "<i4").view(np.uint8), bitorder="little")
        return tuple(int(i) for i in np.flatnonzero(bits[:self.vocab_size]))


def _with_payload(header: SamplingSettings, allowed: tuple[int, ...], blocked: tuple[int, ...],
                  words: np.ndarray) -> SamplingSettings:
    """The settings the header began, completed with the payload's token sets and control words."""
    n = int(words[5])
    bias = tuple((int(words[6 + i]), _bits_f32(int(words[6 + MAX_LOGIT_BIAS + i]))) for i in range(n))
    return dataclasses.replace(header, allowed=allowed, blocked=blocked, top_k=int(words[0]),
                               min_p=_bits_f32(int(words[1])), repetition_penalty=_bits_f32(int(words[2])),
                               presence_penalty=_bits_f32(int(words[3])), frequency_penalty=_bits_f32(int(words[4])),
                               logit_bias=bias)


def codec_for(engine: Any) -> Codec:
    """The codec of a group serving `engine`, the same on every process: a call carries a whole prompt, up to
    the largest prefill bucket (the longest prompt the scheduler accepts, chunked or not)."""
    return Codec(max(engine.buckets), engine.vocab_size)


class Replica:
    """One process's copy of the engine's host-side state; it changes only through `run`, in call order.

    The decode state is used linearly (each call consumes the state the previous one returned, as buffer
    donation requires anyway), so every process holds exactly one; prefixes and chunked-prefill jobs are kept
    by id (one id space) until process 0 releases them.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.state: Any = None
        self.prefixes: dict[int, Any] = {}

    def run(self, call: Call) -> Any:
        """Execute `call` on this process's engine; returns what the Engine method returns."""
        for stale in [p for p in self.prefixes if p < call.release_below]:
            del self.prefixes[stale]
        e = self.engine
        if call.op in (Op.NOOP, Op.SHUTDOWN):
            return None
        if call.op == Op.COMPILE_ALL:
            return e.compile_all()
        if call.op == Op.INIT:
            self.state = e.init_decode_state()
            return self.state
        if call.op == Op.PREFILL:
            prefix, out = e.prefill(call.prompt, call.sampling, seed=call.seed, prompt_logprobs=call.prompt_logprobs)
            self.prefixes[call.prefix] = prefix
            return out
        if call.op == Op.BEGIN_PREFILL:
            self.prefixes[call.prefix] = e.begin_prefill(call.prompt, call.sampling, slot=call.slot, seed=call.seed)
            return None
        if call.op == Op.RESAMPLE:
            prefix, out = e.resample(self.prefixes[call.source], seed=call.seed)
            self.prefixes[call.prefix] = prefix
            return out
        if call.op == Op.PREFILL_CHUNK:
            self.state, out = e.prefill_next_chunk(self.prefixes[call.prefix], self.state)
            return self.state, out
        if call.op == Op.INSERT:
            self.state = e.insert(self.prefixes[call.prefix], self.state, call.slot)
            return self.state
        if call.op == Op.GENERATE:
            self.state, out = e.generate(self.state)
            return self.state, out
        if call.op == Op.FREE:
            self.state = e.free_slot(self.state, call.slot)
            return self.state
        raise ValueError(f"unknown lockstep op {call.op!r}")
