"""Streaming detokenization from a vocabulary's decoding facts: ids in, exact text out.

Both sides of the split use this module: the tokenizer service runs `StreamDecoder` over its loaded
SentencePiece model (`tokenizer_service.tokenizer.Tokenizer`, which measures the facts), and the gateway
runs it in-process over a `PieceTable`, the same facts for every id as plain data that the tokenizer
service sends (GetPieces). Nothing here loads SentencePiece, so the gateway never does.

`StreamDecoder` turns a growing id sequence into text deltas whose concatenation equals
`sentencepiece.decode` of all ids, without ever emitting a replacement character for a UTF-8 character
whose bytes are split across byte-fallback pieces.

How sentencepiece 0.2.3 decodes (the rules `StreamDecoder` mirrors):
- Consecutive byte pieces (`<0xAB>`) form one byte run, decoded when the run ends: at each offset a
  complete, well-formed UTF-8 sequence becomes its character; otherwise that single byte becomes
  U+FFFD and decoding resumes at the next byte (so an incomplete `E4 B8` gives two U+FFFD).
- Every other piece has a fixed surface (control pieces "", the unknown piece its unk surface, a
  normal piece its text with "▁" as a space), except that while the decoder still "expects a
  leading space" one leading "▁" is dropped. It stops expecting one once a piece had its "▁"
  dropped, or once any text was produced before a non-byte piece.
The surfaces are measured from sentencepiece itself by the tokenizer service, so unknown-piece
surfaces and normalizer settings come from the model rather than being re-derived.

A completion is decoded after its prompt (`StreamDecoder.prime`), so its text is what the prompt's
text lacks and its first piece keeps its space; `peek` gives an alternative's text in the same context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from serving_common.failures import DomainError, ErrorKind

REPLACEMENT = "\ufffd"


class TokenizerInputError(DomainError, ValueError):
    """The caller sent something the tokenizer cannot accept (INVALID_ARGUMENT); `field` names it."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(ErrorKind.INVALID_ARGUMENT, message, field=field)


@dataclasses.dataclass(frozen=True)
class PieceSurface:
    """How one non-byte piece decodes: at the start of text (`first`) and anywhere else (`rest`)."""

    first: str
    rest: str

    @property
    def drops_space(self) -> bool:
        """True when this piece loses a leading "▁" at the start of the text."""
        return self.first != self.rest


class Pieces(Protocol):
    """What the incremental detokenizer needs to know about a vocabulary."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def byte_value(self) -> Sequence[int]: ...  # per id: the byte of a byte-fallback piece, -1 for other pieces

    @property
    def strip_all_leading_spaces(self) -> bool: ...

    def surface(self, token_id: int) -> PieceSurface: ...

    def check_ids(self, ids: Sequence[int]) -> None: ...


def check_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Raise TokenizerInputError naming the first id outside [0, vocab_size)."""
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise TokenizerInputError(
                f"token_ids[{index}] = {token_id} is out of range: valid ids are 0..{vocab_size - 1}",
                f"token_ids[{index}]")


@dataclasses.dataclass(frozen=True)
class PieceTable:
    """Every id's decoding facts as data (the tokenizer service's `Tokenizer.piece_table`): a `Pieces`
    without SentencePiece.

    `surfaces[i]` is None exactly for byte pieces (`byte_value[i] >= 0`).
    """

    byte_value: tuple[int, ...]
    surfaces: tuple[PieceSurface | None, ...]
    strip_all_leading_spaces: bool

    def __post_init__(self) -> None:
        if len(self.byte_value) != len(self.surfaces):
            raise ValueError(f"{len(self.byte_value)} byte values but {len(self.surfaces)} surfaces")
        for token_id, (byte, surface) in enumerate(zip(self.byte_value, self.surfaces)):
            if (byte >= 0) == (surface is not None) or byte > 0xFF:
                raise ValueError(f"piece {token_id}: needs a byte value in 0..255 or a surface, not both")

    @property
    def vocab_size(self) -> int:
        return len(self.byte_value)

    def surface(self, token_id: int) -> PieceSurface:
        surface = self.surfaces[token_id]
        if surface is None:
            raise ValueError(f"piece {token_id} is a byte piece: it has no surface")
        return surface

    def check_ids(self, ids: Sequence[int]) -> None:
        check_ids(ids, self.vocab_size)

    def piece_text(self, token_id: int) -> str:
        """The id decoded on its own, exactly as sentencepiece decodes `[token_id]`."""
        self.check_ids((token_id,))
        byte = self.byte_value[token_id]
        if byte >= 0:
            return decode_byte_run(bytearray((byte,)), final=True)
        return self.surface(token_id).first

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


def _utf8_sequence_length(lead: int) -> tuple[int, int, int]:
    """(length, low, high) of the sequence `lead` starts; low..high bounds its second byte.

    Length 0 means `lead` cannot start a well-formed sequence (stray continuation byte, C0/C1
    overlong leads, F5..FF beyond U+10FFFF). The second-byte bounds exclude overlong forms,
    surrogates and code points above U+10FFFF, as sentencepiece's decoder does.
    """
    if lead < 0x80:
        return 1, 0, 0
    if 0xC2 <= lead <= 0xDF:
        return 2, 0x80, 0xBF
    if lead == 0xE0:
        return 3, 0xA0, 0xBF
    if lead == 0xED:
        return 3, 0x80, 0x9F
    if 0xE1 <= lead <= 0xEF:
        return 3, 0x80, 0xBF
    if lead == 0xF0:
        return 4, 0x90, 0xBF
    if 0xF1 <= lead <= 0xF3:
        return 4, 0x80, 0xBF
    if lead == 0xF4:
        return 4, 0x80, 0x8F
    return 0, 0, 0


def _sequence_at(run: bytes | bytearray, start: int, final: bool) -> int:
    """Length of the character starting at run[start]: n > 0 valid, -1 invalid byte, 0 undecided.

    Undecided means the bytes so far are a proper prefix of a valid sequence and the run may
    still grow; with `final` the run is complete, so such a prefix is invalid.
    """
    length, low, high = _utf8_sequence_length(run[start])
    if length == 0:
        return -1
    for k in range(1, length):
        if start + k >= len(run):
            return -1 if final else 0
        lo, hi = (low, high) if k == 1 else (0x80, 0xBF)
        if not lo <= run[start + k] <= hi:
            return -1
    return length


def decode_byte_run(run: bytearray, final: bool) -> str:
    """Decode the settled prefix of a byte run and remove it from `run` (in place).

    With `final` everything is settled; otherwise the bytes of a character that may still be
    completed stay in `run`.
    """
    out: list[str] = []
    pos = 0
    while pos < len(run):
        length = _sequence_at(run, pos, final)
        if length == 0:
            break
        if length < 0:
            out.append(REPLACEMENT)
            pos += 1
        else:
            out.append(bytes(run[pos:pos + length]).decode("utf-8"))
            pos += length
    del run[:pos]
    return "".join(out)


class StreamDecoder:
    """Incremental detokenizer for one sequence: feed ids, get the text each one made final.

    The state is tiny (up to three undecided bytes and a few flags), never the whole id history, so a
    stream of any length costs O(1) memory. `pieces` is the tokenizer service's Tokenizer or a PieceTable
    of it: the same facts, so the same text.
    """

    def __init__(self, pieces: Pieces) -> None:
        self._tok = pieces
        self._run = bytearray()  # undecided bytes of the current byte-piece run
        self._expect_space = True  # sentencepiece would still drop a leading "▁"
        self._dropped_space = False  # the previous non-byte piece had its "▁" dropped
        self._has_text = False
        self._started = False  # an id was pushed (prime() must come first)

    @property
    def pending(self) -> bool:
        """True while bytes are held back waiting for the rest of a character."""
        return bool(self._run)

    def prime(self, ids: Sequence[int]) -> None:
        """Read `ids` (the prompt) as text already returned, before any generated id is pushed.

        SentencePiece drops a leading space only at the very start of a text, so the first generated
        piece keeps it after a prompt (" large", not "large"): then the prompt's text followed by the
        deltas is the decode of prompt and completion together. Bytes of a character the prompt leaves
        incomplete stay held back and come out with the completion's text.
        """
        if self._started:
            raise TokenizerInputError("the prompt's ids must come before the first generated id", "prompt_ids")
        self._tok.check_ids(ids)
        for token_id in ids:
            self.push(token_id)

    def peek(self, token_id: int) -> str:
        """The text `token_id` would add if it were pushed now (an alternative's text in context);
        the decoder's state does not change."""
        saved = (bytes(self._run), self._expect_space, self._dropped_space, self._has_text, self._started)
        try:
            return self.push(token_id)
        finally:
            run, self._expect_space, self._dropped_space, self._has_text, self._started = saved
            self._run[:] = run

    def push_with_alternatives(self, ids: Sequence[int],
                               alternatives: Sequence[Sequence[int]]) -> tuple[list[str], list[list[str]]]:
        """Per-id texts, and for each id the texts its `alternatives` would have added in its place.

        `alternatives` has one (possibly empty) list per id, or is empty; every id is checked first."""
        if alternatives and len(alternatives) != len(ids):
            raise TokenizerInputError(f"alternatives has {len(alternatives)} entries for {len(ids)} token ids: "
                                      "send one per token id, or none", "alternatives")
        self._tok.check_ids(ids)
        for index, others in enumerate(alternatives):
            try:
                self._tok.check_ids(others)
            except TokenizerInputError as error:
                raise TokenizerInputError(f"alternatives[{index}]: {error}", f"alternatives[{index}]") from None
        texts: list[str] = []
        others_texts: list[list[str]] = []
        for index, token_id in enumerate(ids):
            others_texts.append([self.peek(other) for other in alternatives[index]] if alternatives else [])
            texts.append(self.push(token_id))
        return texts, others_texts

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became final (possibly "")."""
        tok = self._tok
        if not 0 <= token_id < tok.vocab_size:
            raise TokenizerInputError(f"token id {token_id} is out of range: valid ids are 0..{tok.vocab_size - 1}",
                                      "token_ids")
        self._started = True
        byte = tok.byte_value[token_id]
        if byte >= 0:
            self._run.append(byte)
            return self._emit(decode_byte_run(self._run, final=False))
        settled = self._emit(decode_byte_run(self._run, final=True))
        if self._has_text or self._dropped_space:
            self._expect_space = False
        surface = tok.surface(token_id)
        text = surface.first if self._expect_space else surface.rest
        self._dropped_space = (self._expect_space and surface.drops_space
                               and not tok.strip_all_leading_spaces)
        return settled + self._emit(text)

    def push_many(self, ids: Sequence[int]) -> list[str]:
        """Per-id texts for a batch of ids; all ids are checked before any is applied."""
        self._tok.check_ids(ids)
        return [self.push(token_id) for token_id in ids]

    def flush(self) -> str:
        """End of stream: settle held-back bytes exactly as decode would (U+FFFD per stray byte)."""
        return self._emit(decode_byte_run(self._run, final=True))

    def _emit(self, text: str) -> str:
        if text:
            self._has_text = True
        return text
