"""The two ways the gateway turns generated ids into text, behind one interface (`TextStream`).

- remote (the default, the documented architecture): a DecodeStream call to the tokenizer service per
  request, one message each way per model message (`gateway.clients.Detokenizer`);
- local (`--detokenize local`): the tokenizer service's own incremental detokenizer
  (`tokenizer_service.tokenizer.StreamDecoder`) run in the gateway over the vocabulary's piece table,
  fetched once from the tokenizer service (GetPieces) and fetched again whenever that service comes
  back after being down (it may serve another model then). The gateway never reads the tokenizer
  file. Same code over the same facts gives the same text; what goes away is two gRPC messages per
  model message in the gateway and all of the tokenizer service's per-token work (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import grpc

from gateway.errors import GatewayError
from grok.tokenizer.v1 import tokenizer_pb2
from serving_common.errors import FieldViolation
from tokenizer_service.tokenizer import PieceSurface, PieceTable, TokenizerInputError


class TextStream(Protocol):
    """One request's incremental detokenization."""

    async def push(self, token_ids: Sequence[int]) -> tuple[str, list[str]]:
        """Add ids; return the new text and the part of it each id produced."""
        ...

    async def finish(self) -> str:
        """The end of the ids: the text still held back (bytes of an incomplete character, decoded)."""
        ...

    def cancel(self) -> None: ...


def invalid_id(error: TokenizerInputError) -> GatewayError:
    """What the remote path answers for an id the tokenizer does not know (the tokenizer service's
    INVALID_ARGUMENT, passed through): the same status and message in both modes."""
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"tokenizer service: {error}",
                        violations=(FieldViolation(error.field, str(error)),))


class LocalDetokenizer:
    """A StreamDecoder over the piece table, in the gateway's event loop (no I/O, no waiting)."""

    def __init__(self, table: PieceTable) -> None:
        self.decoder = table.stream_decoder()

    async def push(self, token_ids: Sequence[int]) -> tuple[str, list[str]]:
        try:
            texts = self.decoder.push_many(token_ids)
        except TokenizerInputError as error:
            raise invalid_id(error) from None
        return "".join(texts), texts

    async def finish(self) -> str:
        return self.decoder.flush()

    def cancel(self) -> None:
        """Nothing to release: the decoder is a few bytes of state."""


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
