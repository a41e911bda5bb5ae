"""The lockstep messages: the few Engine calls process 0 makes, as fixed-shape int32 arrays.

A multi-process replica runs the same compiled programs on every process in the same order. Process 0's
scheduler decides everything (it owns the KV block allocator and the per-request state); each step is one
value, a step_batch.StepBatch with the block tables inside, so followers hold no allocator and replay nothing:
before each Engine call process 0 broadcasts it (`Codec.header` / `Codec.payload`) and then every process,
itself included, executes the decoded call on its own `Replica`. Because both sides execute the *decoded*
call, their engines receive identical arguments by construction.

A call is one fixed-size message, a header [HEADER_SIZE] (op, call number, rows in use, how many slots start,
how many masks, whether rows are scored) followed by the parts every step has (the rows, the block tables, the
draws): a decode step is that one broadcast. Only a step that has them sends its other parts next, in one
broadcast whose shapes the header and the engine's configuration fix: the starts (settings, token sets as
bitmaps over the vocabulary, the tokens the penalties count), the masks (bitmaps), the scored rows, the
speculative chains.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from model_service.sampling_settings import MAX_ENDS, MAX_LOGIT_BIAS, SamplingSettings
from model_service.step_batch import SlotStart, StepBatch

log = logging.getLogger(__name__)


class Op(enum.IntEnum):
    NOOP = 0  # keep-alive: proves every process still follows
    SHUTDOWN = 1  # process 0 is stopping cleanly; followers leave their loop
    COMPILE = 2  # Engine.compile()
    INIT = 3  # Engine.init_state()
    STEP = 4  # Engine.step(state, batch)


class Field(enum.IntEnum):
    """Positions in the int32 header."""

    OP = 0
    SEQ = 1  # call number: a follower that sees a gap has diverged
    ROWS = 2
    STARTS = 3
    MASKS = 4
    SCORED = 5
    SPECULATIVE = 6  # draws carry their chain, next draft and pending drafts


HEADER_SIZE = 7
_ENDS_AT = 13 + 2 * MAX_LOGIT_BIAS  # where min_tokens, the number of ending ids and the ids start
# slot, seed, lengths, reference settings; controls; logit_bias; min_tokens and its ending ids
START_WORDS = _ENDS_AT + 2 + MAX_ENDS


@dataclass(frozen=True)
class Call:
    """One Engine call with what it takes."""

    op: Op
    seq: int = 0
    batch: StepBatch | None = None  # STEP


def _f32_bits(x: float) -> int:
    return int(np.array(x, np.float32).view(np.int32))


def _bits_f32(bits: int) -> float:
    return float(np.array(bits, np.int32).view(np.float32))


class Codec:
    """Calls as fixed-shape int32 arrays (a collective needs the same shapes on every process)."""

    def __init__(self, rows: int, samples: int, slots: int, table_len: int, context: int, vocab_size: int,
                 drafts: int = 0) -> None:
        self.rows, self.samples, self.slots, self.drafts = rows, samples, slots, drafts
        self.table_len, self.context, self.vocab_size = table_len, context, vocab_size
        self.bitmap_words = -(-vocab_size // 32)
        self._base = [(4, rows), (slots, table_len), (2, samples)]  # rows, block tables, draws
        self._first_words = HEADER_SIZE + sum(int(np.prod(shape)) for shape in self._base)

    def header(self, call: Call) -> np.ndarray:
        h = np.zeros((HEADER_SIZE,), np.int32)
        h[Field.OP], h[Field.SEQ] = int(call.op), call.seq
        b = call.batch
        if b is not None:
            h[Field.ROWS], h[Field.STARTS], h[Field.MASKS] = b.rows, len(b.starts), len(b.masks)
            h[Field.SCORED] = b.score is not None
            h[Field.SPECULATIVE] = b.sample_chain is not None
        return h

    def base_shapes(self, header: np.ndarray) -> list[tuple[int, ...]]:
        """The parts every STEP has (rows, block tables, draws): they travel with the header."""
        return list(self._base) if Op(int(header[Field.OP])) == Op.STEP else []

    def first_message(self, header: np.ndarray, base: Sequence[np.ndarray]) -> np.ndarray:
        """The header and a step's base parts in one fixed-size array (zeros where a call has no parts)."""
        out = self.empty_first_message()
        out[:HEADER_SIZE] = header
        flat = np.concatenate([np.asarray(a, np.int32).ravel() for a in base]) if base else out[:0]
        out[HEADER_SIZE:HEADER_SIZE + flat.size] = flat
        return out

    def empty_first_message(self) -> np.ndarray:
        return np.zeros((self._first_words,), np.int32)

    def split_first_message(self, first: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """`first_message`'s header and base parts."""
        header = np.asarray(first[:HEADER_SIZE], np.int32)
        parts, at = [], HEADER_SIZE
        for shape in self.base_shapes(header):
            n = int(np.prod(shape))
            parts.append(np.asarray(first[at:at + n], np.int32).reshape(shape))
            at += n
        return header, tuple(parts)

    def shapes(self, header: np.ndarray) -> list[tuple[int, ...]]:
        """The payload arrays' shapes a header announces (none unless it is a STEP)."""
        if Op(int(header[Field.OP])) != Op.STEP:
            return []
        r, s, w = self.rows, self.slots, self.bitmap_words
        out = self.base_shapes(header)
        if header[Field.STARTS]:
            out += [(s, START_WORDS), (s, 2, w), (s, self.context)]
        if header[Field.MASKS]:
            out += [(s,), (s, w)]
        if header[Field.SCORED]:
            out += [(2, r)]
        if header[Field.SPECULATIVE]:
            out += [(2, self.samples), (self.samples, self.drafts)]
        return out

    def empty_payload(self, header: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(np.zeros(shape, np.int32) for shape in self.shapes(header))

    def payload(self, call: Call) -> tuple[np.ndarray, ...]:
        b = call.batch
        if b is None:
            return ()
        if len(b.starts) > self.slots or len(b.masks) > self.slots:
            raise ValueError(f"a step starts or masks at most {self.slots} slots")
        parts = [np.stack([b.tokens, b.from_last, b.positions, b.seq]).astype(np.int32),
                 np.asarray(b.tables, np.int32), np.stack([b.sample_rows, b.sample_slots]).astype(np.int32)]
        if b.starts:
            parts += self._starts(b.starts)
        if b.masks:
            slots = np.full((self.slots,), self.slots, np.int32)
            bitmaps = np.zeros((self.slots, self.bitmap_words), np.int32)
            for i, (slot, mask) in enumerate(b.masks):
                slots[i], bitmaps[i] = slot, self._bitmap(np.asarray(mask, bool))
            parts += [slots, bitmaps]
        if b.score is not None:
            parts.append(np.stack([b.score, b.targets]).astype(np.int32))
        if b.sample_chain is not None:
            parts += [np.stack([b.sample_chain, b.sample_next]).astype(np.int32),
                      np.asarray(b.sample_pending, np.int32).reshape(self.samples, self.drafts)]
        return tuple(parts)

    def _starts(self, starts: tuple[SlotStart, ...]) -> list[np.ndarray]:
        words = np.zeros((self.slots, START_WORDS), np.int32)
        bitmaps = np.zeros((self.slots, 2, self.bitmap_words), np.int32)
        tokens = np.zeros((self.slots, self.context), np.int32)
        for i, st in enumerate(starts):
            c = st.settings
            ids = st.prompt + st.drawn
            if len(ids) > self.context or len(c.logit_bias) > MAX_LOGIT_BIAS or len(c.ends) > MAX_ENDS:
                raise ValueError(f"a start holds at most {self.context} tokens, {MAX_LOGIT_BIAS} logit_bias entries "
                                 f"and {MAX_ENDS} ending ids")
            words[i, :13] = [st.slot, int(np.array(st.seed, np.uint32).view(np.int32)), len(st.prompt), len(st.drawn),
                             _f32_bits(c.temperature), _f32_bits(c.top_p), c.top_logprobs, c.top_k, _f32_bits(c.min_p),
                             _f32_bits(c.repetition_penalty), _f32_bits(c.presence_penalty),
                             _f32_bits(c.frequency_penalty), len(c.logit_bias)]
            for j, (token, bias) in enumerate(c.logit_bias):
                words[i, 13 + j], words[i, 13 + MAX_LOGIT_BIAS + j] = token, _f32_bits(bias)
            words[i, _ENDS_AT:_ENDS_AT + 2 + len(c.ends)] = [c.min_tokens, len(c.ends), *c.ends]
            bitmaps[i, 0] = self._bitmap(self._mask(c.allowed))
            bitmaps[i, 1] = self._bitmap(self._mask(c.blocked))
            tokens[i, :len(ids)] = ids
        return [words, bitmaps, tokens]

    def decode(self, header: np.ndarray, payload: Sequence[np.ndarray]) -> Call:
        op, seq = Op(int(header[Field.OP])), int(header[Field.SEQ])
        if op != Op.STEP:
            return Call(op, seq)
        parts = list(payload)
        rows, tables, samples = parts[:3]
        rest = parts[3:]
        starts: tuple[SlotStart, ...] = ()
        masks: tuple[tuple[int, np.ndarray], ...] = ()
        if header[Field.STARTS]:
            starts = self._decode_starts(int(header[Field.STARTS]), *rest[:3])
            rest = rest[3:]
        if header[Field.MASKS]:
            slots, bitmaps = rest[:2]
            masks = tuple((int(slots[i]), self._unbitmap(bitmaps[i])) for i in range(int(header[Field.MASKS])))
            rest = rest[2:]
        score = targets = None
        if header[Field.SCORED]:
            score, targets = rest[0][0].astype(bool), rest[0][1].astype(np.int32)
            rest = rest[1:]
        chain = nxt = pending = None
        if header[Field.SPECULATIVE]:
            chain, nxt, pending = rest[0][0].astype(np.int32), rest[0][1].astype(np.int32), rest[1].astype(np.int32)
        batch = StepBatch(rows[0].astype(np.int32), rows[1].astype(bool), rows[2].astype(np.int32),
                          rows[3].astype(np.int32), int(header[Field.ROWS]), tables.astype(np.int32),
                          samples[0].astype(np.int32), samples[1].astype(np.int32), score, targets, starts, masks,
                          chain, nxt, pending)
        return Call(op, seq, batch)

    def _decode_starts(self, n: int, words: np.ndarray, bitmaps: np.ndarray, tokens: np.ndarray) -> tuple[SlotStart, ...]:
        out = []
        for i in range(n):
            w = [int(x) for x in words[i]]
            bias = tuple((w[13 + j], _bits_f32(w[13 + MAX_LOGIT_BIAS + j])) for j in range(w[12]))
            settings = SamplingSettings(
                temperature=_bits_f32(w[4]), top_p=_bits_f32(w[5]), top_logprobs=w[6],
                allowed=self._ids(bitmaps[i, 0]), blocked=self._ids(bitmaps[i, 1]), top_k=w[7], min_p=_bits_f32(w[8]),
                repetition_penalty=_bits_f32(w[9]), presence_penalty=_bits_f32(w[10]),
                frequency_penalty=_bits_f32(w[11]), logit_bias=bias, min_tokens=w[_ENDS_AT],
                ends=tuple(w[_ENDS_AT + 2:_ENDS_AT + 2 + w[_ENDS_AT + 1]]))
            ids = tuple(int(t) for t in tokens[i, :w[2] + w[3]])
            out.append(SlotStart(w[0], int(np.array(w[1], np.int32).view(np.uint32)), settings, ids[:w[2]], ids[w[2]:]))
        return tuple(out)

    def _mask(self, ids: Sequence[int]) -> np.ndarray:
        mask = np.zeros((self.vocab_size,), bool)
        mask[np.asarray(ids, np.int64)] = True
        return mask

    def _bitmap(self, mask: np.ndarray) -> np.ndarray:
        padded = np.zeros((self.bitmap_words * 32,), bool)
        padded[:mask.shape[0]] = mask
        return np.packbits(padded, bitorder="little").view("<i4")

    def _unbitmap(self, words: np.ndarray) -> np.ndarray:
        bits = np.unpackbits(np.ascontiguousarray(words, "<i4").view(np.uint8), bitorder="little")
        return bits[:self.vocab_size].astype(bool)

    def _ids(self, words: np.ndarray) -> tuple[int, ...]:
        return tuple(int(i) for i in np.flatnonzero(self._unbitmap(words)))


def codec_for(engine: Any) -> Codec:
    """The codec of a group serving `engine`, the same on every process."""
    return Codec(engine.max_rows, engine.max_samples, engine.slots, engine.table_len, engine.sequence_len,
                 engine.vocab_size, getattr(engine, "draft_tokens", 0))


class Replica:
    """One process's engine and its one state; the state changes only through `run`, in call order (each call
    consumes the state the previous one returned, as buffer donation requires anyway)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.state: Any = None

    def run(self, call: Call) -> Any:
        """Execute `call` on this process's engine; returns what the Engine method returns."""
        e = self.engine
        if call.op in (Op.NOOP, Op.SHUTDOWN):
            return None
        if call.op == Op.COMPILE:
            return e.compile()
        if call.op == Op.INIT:
            self.state = e.init_state()
            return self.state
        if call.op == Op.STEP:
            assert call.batch is not None
            self.state, pending = e.step(self.state, call.batch)
            return self.state, pending
        raise ValueError(f"unknown lockstep op {call.op!r}")
