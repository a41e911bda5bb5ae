"""The two ways the gateway turns generated ids into text, behind one interface (`TextStream`).

Either way every text is a text in context: a completion's detokenizer first reads the prompt's ids
(they give no text), so the first generated piece keeps the leading space SentencePiece drops only at
the very start of a text, and `prompt text + completion text == decode(prompt ids + completion ids)`;
an alternative's text is what it would have added in the chosen token's place (docs/api.md).

- remote (`--detokenize remote`): a DecodeStream call to the tokenizer service per request, one message
  each way per model message (`gateway.clients.Detokenizer`);
- local (the default): the incremental detokenizer the tokenizer service runs
  (`serving_common.detokenizer.StreamDecoder`), run in the gateway over the vocabulary's piece table,
  fetched once from the tokenizer service (GetPieces) and fetched again whenever that service comes
  back after being down (it may serve another model then). The gateway never reads the tokenizer
  file. Same code over the same facts gives the same text; what goes away is two gRPC messages per
  model message in the gateway and all of the tokenizer service's per-token work (docs/benchmarks.md).
  The tokenizer service stays the owner of tokenization: it encodes every prompt and it alone measures
  the facts the table holds (from its SentencePiece model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from gateway.errors import GatewayError
from grok.tokenizer.v1 import tokenizer_pb2
from serving_common.detokenizer import PieceSurface, PieceTable, TokenizerInputError
from serving_common.errors import domain_status


@dataclass(frozen=True)
class Decoded:
    """What one push made final: the new text, each id's part of it, and (when alternatives were given)
    for each id the texts its alternatives would have added in its place (None: the tokenizer service
    did not answer them, an older version)."""

    text: str
    token_texts: list[str]
    alternative_texts: list[list[str]] | None = None


class TextStream(Protocol):
    """One completion's incremental detokenization, after its prompt."""

    async def push(self, token_ids: Sequence[int], alternatives: Sequence[Sequence[int]] = ()) -> Decoded:
        """Add ids (with, optionally, each one's alternatives); return what became final."""
        ...

    async def finish(self) -> str:
        """The end of the ids: the text still held back (bytes of an incomplete character, decoded)."""
        ...

    def cancel(self) -> None: ...


def invalid_id(error: TokenizerInputError) -> GatewayError:
    """What the remote path answers for an id the tokenizer does not know (the tokenizer service's
    INVALID_ARGUMENT, passed through): the same status and message in both modes."""
    status = domain_status(error)
    return GatewayError(status.code, f"tokenizer service: {status.message}", violations=status.violations)


class LocalDetokenizer:
    """A StreamDecoder over the piece table, in the gateway's event loop (no I/O, no waiting).

    The prompt's ids are read with the first push, as the remote DecodeStream reads them with its first
    message, so that both give the same text however the stream ends."""

    def __init__(self, table: PieceTable, prompt_ids: Sequence[int] = ()) -> None:
        self.decoder = table.stream_decoder()
        self.prompt_ids: Sequence[int] | None = prompt_ids

    async def push(self, token_ids: Sequence[int], alternatives: Sequence[Sequence[int]] = ()) -> Decoded:
        try:
            if self.prompt_ids is not None:
                self.decoder.prime(self.prompt_ids)
                self.prompt_ids = None
            texts, others = self.decoder.push_with_alternatives(token_ids, alternatives)
        except TokenizerInputError as error:
            raise invalid_id(error) from None
        return Decoded("".join(texts), texts, others if alternatives else None)

    async def finish(self) -> str:
        return self.decoder.flush()

    def cancel(self) -> None:
        """Nothing to release: the decoder is a few bytes of state."""


def texts_in_context(table: PieceTable, ids: Sequence[int],
                     alternatives: Sequence[Sequence[int]]) -> tuple[list[str], list[list[str]]]:
    """Each id's text after the ids before it (a scored prompt), and its alternatives' texts in its place;
    what a DecodeStream of `ids` alone answers."""
    decoder = table.stream_decoder()
    try:
        texts, others = decoder.push_with_alternatives(ids, alternatives)
    except TokenizerInputError as error:
        raise invalid_id(error) from None
    tail = decoder.flush()
    if tail and texts:
        texts[-1] += tail
    return texts, others


def bad_table(detail: str) -> GatewayError:
    """INTERNAL: a tokenizer service that cannot give a usable piece table is a deployment bug, not
    something a retry fixes."""
    return GatewayError(grpc.StatusCode.INTERNAL, f"the tokenizer service sent no usable piece table ({detail}); "
                        "the gateway's --detokenize local needs one")


def piece_table(chunks: Iterable[tokenizer_pb2.GetPiecesResponse]) -> PieceTable:
    """The table from a GetPieces stream; INTERNAL naming what is wrong for a stream that does not
    describe every id exactly once, in order, of one model."""
    byte_value: list[int] = []
    surfaces: list[PieceSurface | None] = []
    first: tokenizer_pb2.GetPiecesResponse | None = None
    for chunk in chunks:
        first = first or chunk
        if (chunk.vocab_size, chunk.model_sha256, chunk.strip_all_leading_spaces) != (
                first.vocab_size, first.model_sha256, first.strip_all_leading_spaces):
            raise bad_table("it changed while it was sent")
        if chunk.start_id != len(byte_value):
            raise bad_table(f"it skipped from id {len(byte_value)} to {chunk.start_id}")
        for piece in chunk.pieces:
            byte_value.append(piece.byte_value if piece.is_byte else -1)
            surfaces.append(None if piece.is_byte else PieceSurface(
                piece.first_text if piece.HasField("first_text") else piece.text, piece.text))
    if first is None or len(byte_value) != first.vocab_size:
        raise bad_table(f"{len(byte_value)} pieces for a vocabulary of {first.vocab_size if first else 0}")
    try:
        return PieceTable(tuple(byte_value), tuple(surfaces), first.strip_all_leading_spaces)
    except ValueError as error:
        raise bad_table(str(error)) from None
