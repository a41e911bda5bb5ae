"""The tokenizer service's SentencePiece model: encode, decode, and the decoding facts of every piece.

`Tokenizer` encodes and decodes exactly as sentencepiece does (the gateway and the model service
agree on ids through it). It also measures what streaming detokenization needs to know about each
piece (byte values, surfaces, the leading-space rule: `serving_common.detokenizer.Pieces`), taken from
sentencepiece itself (decode of the id alone, and after a probe piece), so unknown-piece surfaces and
normalizer settings come from the model rather than being re-derived. `stream_decoder()` runs the
shared `StreamDecoder` over those facts; `piece_table()` gives them as plain data, which the service
sends to a gateway that detokenizes in-process (GetPieces) without ever loading the SentencePiece model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import re
from collections.abc import Sequence

import sentencepiece

from serving_common.detokenizer import PieceSurface, PieceTable, StreamDecoder, TokenizerInputError, check_ids

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclasses.dataclass(frozen=True)
class VocabInfo:
    """Vocabulary size, special ids (-1 when absent) and the model file's identity."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    model_sha256: str
    model_path: str


class Tokenizer:
    """One loaded SentencePiece model: encode, decode, vocabulary facts, per-piece surfaces."""

    def __init__(self, model_path: str | pathlib.Path) -> None:
        path = pathlib.Path(model_path)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise FileNotFoundError(f"cannot read SentencePiece model {path}: {err}") from err
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(data)
        except (RuntimeError, OSError) as err:
            raise ValueError(f"{path} is not a SentencePiece model: {err}") from err
        self.path = str(path)
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size: int = self.sp.get_piece_size()
        self.byte_value: list[int] = [self._byte_of(i) for i in range(self.vocab_size)]
        self._surfaces: list[PieceSurface | None] = [None] * self.vocab_size
        self._probe_id, self._probe_text = self._find_probe()
        self.strip_all_leading_spaces = self._strips_repeatedly()
        self._table: PieceTable | None = None

    def _byte_of(self, token_id: int) -> int:
        if not self.sp.is_byte(token_id):
            return -1
        match = _BYTE_PIECE.fullmatch(self.sp.id_to_piece(token_id))
        if match is None:
            raise ValueError(f"byte piece {token_id} has unexpected form {self.sp.id_to_piece(token_id)!r}")
        return int(match.group(1), 16)

    def _find_probe(self) -> tuple[int, str]:
        """A piece whose decode is non-empty: decoding it first makes the next piece non-initial."""
        candidates = [self.sp.unk_id(), *(i for i, b in enumerate(self.byte_value) if b == 0x41)]
        for token_id in [*candidates, *range(self.vocab_size)]:
            if 0 <= token_id < self.vocab_size:
                text = self.sp.decode([token_id])
                if text:
                    return token_id, text
        raise ValueError(f"{self.path}: no piece decodes to text")

    def _strips_repeatedly(self) -> bool:
        """Whether a piece that is only "▁" keeps the decoder expecting a leading space.

        Models with remove_extra_whitespaces drop every leading "▁" until text appears; others
        drop only the first. Only a bare "▁" piece can tell the two apart.
        """
        bare = self.sp.piece_to_id("\u2581")
        if bare == self.sp.unk_id() or self.byte_value[bare] >= 0 or self.surface(bare).first:
            return False
        return self.sp.decode([bare, bare]) == ""

    def surface(self, token_id: int) -> PieceSurface:
        """The decoded surfaces of a non-byte piece, measured with sentencepiece (cached)."""
        cached = self._surfaces[token_id]
        if cached is None:
            first = self.sp.decode([token_id])
            rest = self.sp.decode([self._probe_id, token_id])[len(self._probe_text):]
            cached = self._surfaces[token_id] = PieceSurface(first, rest)
        return cached

    def info(self) -> VocabInfo:
        return VocabInfo(self.vocab_size, self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id(),
                         self.sp.unk_id(), self.sha256, self.path)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`; no BOS unless asked, as the Grok-1 reference encodes prompts."""
        ids: list[int] = self.sp.encode(text)
        if add_bos:
            ids.insert(0, self._special("bos", self.sp.bos_id()))
        if add_eos:
            ids.append(self._special("eos", self.sp.eos_id()))
        return ids

    def _special(self, name: str, token_id: int) -> int:
        if token_id < 0:
            raise TokenizerInputError(f"add_{name} was requested but the model defines no {name.upper()} piece",
                                     f"add_{name}")
        return token_id

    def check_ids(self, ids: Sequence[int]) -> None:
        """Raise TokenizerInputError naming the first id outside [0, vocab_size)."""
        check_ids(ids, self.vocab_size)

    def piece_table(self) -> PieceTable:
        """Every piece's decoding facts (measures every surface once: ~2 decode calls per piece)."""
        if self._table is None:
            surfaces = tuple(None if byte >= 0 else self.surface(i) for i, byte in enumerate(self.byte_value))
            self._table = PieceTable(tuple(self.byte_value), surfaces, self.strip_all_leading_spaces)
        return self._table

    def decode(self, ids: Sequence[int]) -> str:
        """Exactly sentencepiece's decode (control pieces give "")."""
        self.check_ids(ids)
        return self.sp.decode(list(ids))

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)
