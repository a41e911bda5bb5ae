"""gRPC TokenizerService: protobuf <-> Tokenizer, and input limits.

The shared interceptor (serving_common.interceptor) gives every RPC its request id and ends it with
the status serving_common.errors.status_of gives a raised TokenizerInputError (INVALID_ARGUMENT). Small inputs are handled on the event loop; large ones go
to a worker thread so one 1 MiB text does not stall every other call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import grpc

from grok.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from serving_common.detokenizer import PieceTable, StreamDecoder, TokenizerInputError
from serving_common.errors import status_of, unavailable
from tokenizer_service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")

# Inputs above this size (bytes of text or number of ids) are processed off the event loop.
_INLINE_LIMIT = 16 * 1024
# Pieces per GetPieces message: the Grok-1 vocabulary (131,072 pieces, ~1.5 MB) in 8 messages of
# ~200 KB, well under gRPC's default 4 MB message limit.
PIECES_PER_MESSAGE = 16384


@dataclasses.dataclass(frozen=True)
class Limits:
    """Request size limits (the service's --max-* flags)."""

    max_text_bytes: int = 1 << 20
    max_batch: int = 256
    max_tokens: int = 1 << 20


def _code(err: Exception) -> grpc.StatusCode:
    """The status the interceptor will end the call with (for the log line)."""
    status = status_of(err)
    return status.code if status is not None else grpc.StatusCode.INTERNAL


def piece_messages(table: PieceTable, model_sha256: str) -> list[tokenizer_pb2.GetPiecesResponse]:
    """The GetPieces stream for `table`: consecutive chunks of PIECES_PER_MESSAGE ids."""
    pieces = [tokenizer_pb2.Piece(is_byte=True, byte_value=byte) if surface is None else
              tokenizer_pb2.Piece(text=surface.rest, first_text=surface.first) if surface.drops_space else
              tokenizer_pb2.Piece(text=surface.rest)
              for byte, surface in zip(table.byte_value, table.surfaces)]
    return [tokenizer_pb2.GetPiecesResponse(
        vocab_size=table.vocab_size, model_sha256=model_sha256, strip_all_leading_spaces=table.strip_all_leading_spaces,
        start_id=start, pieces=pieces[start:start + PIECES_PER_MESSAGE])
        for start in range(0, table.vocab_size, PIECES_PER_MESSAGE)]


# After the last Encode answered, how long a drain waits for the DecodeStream a gateway opens right after it.
SETTLE_SECONDS = 1.0


class Workload:
    """Calls in flight, for a drain that finishes what was routed here and takes nothing new.

    A request is routed to a tokenizer by its Encode; the gateway then opens the request's DecodeStream at
    once and may call Decode while it generates. So a draining tokenizer refuses Encode (new requests go
    elsewhere or get UNAVAILABLE) and serves every other call until none is in flight and no Encode was
    answered for SETTLE_SECONDS (the gap before a just-encoded request's DecodeStream arrives).
    """

    def __init__(self) -> None:
        self.open = 0
        self.draining = False
        self.last_encode = -math.inf

    @contextlib.contextmanager
    def call(self, encodes: bool = False) -> Iterator[None]:
        if encodes and self.draining:
            raise unavailable("the tokenizer service is shutting down; retry (on another replica, or once it "
                              "is back)", retry_after=1.0)
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1
            if encodes:
                self.last_encode = time.monotonic()

    async def drain(self, timeout: float) -> None:
        """Refuse new work, then wait (at most `timeout` seconds) until the work already routed here is done."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.open or time.monotonic() - self.last_encode < SETTLE_SECONDS):
            await asyncio.sleep(0.05)
        log.info("drained", extra={"calls_in_flight": self.open})


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Serves one loaded SentencePiece model."""

    def __init__(self, tokenizer: Tokenizer, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.work = Workload()
        self._pieces: asyncio.Future[list[tokenizer_pb2.GetPiecesResponse]] | None = None

    # --- validation -------------------------------------------------------------------------

    def _check_text(self, text: str, field: str) -> int:
        size = len(text.encode("utf-8"))
        if size > self.limits.max_text_bytes:
            raise TokenizerInputError(
                f"{field} is {size} bytes of UTF-8; the limit is {self.limits.max_text_bytes} bytes "
                "(--max-text-bytes): split the text", field)
        return size

    def _check_id_count(self, count: int, field: str) -> None:
        if count > self.limits.max_tokens:
            raise TokenizerInputError(
                f"{field} has {count} ids; the limit is {self.limits.max_tokens} (--max-tokens): send fewer per call",
                field)

    # --- call plumbing ----------------------------------------------------------------------

    async def _unary(self, method: str, work: Callable[[], tuple[T, int]], threaded: bool) -> T:
        """Run `work` (validate, compute; returns the result and its input size); errors end the call (status_of)."""
        started = time.perf_counter()
        try:
            result, size = await asyncio.to_thread(work) if threaded else work()
        except Exception as err:
            self._log_done(method, _code(err), started)
            raise
        self._log_done(method, grpc.StatusCode.OK, started, size=size)
        return result

    @staticmethod
    def _log_done(method: str, code: grpc.StatusCode, started: float, **extra: int) -> None:
        elapsed_ms = round((time.perf_counter() - started) * 1000, 3)
        # A successful call is one of several per request: the gateway's access line speaks for the request, so
        # these show only with --log-level debug; a failed one shows at info.
        level = logging.DEBUG if code == grpc.StatusCode.OK else logging.INFO
        log.log(level, "rpc", extra={"method": method, "code": code.name, "ms": elapsed_ms, **extra})

    # --- RPCs -------------------------------------------------------------------------------

    async def Encode(self, request: tokenizer_pb2.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> tokenizer_pb2.EncodeResponse:
        threaded = len(request.text) > _INLINE_LIMIT
        with self.work.call(encodes=True):
            return await self._unary("Encode", lambda: self._encode(request), threaded)

    def _encode(self, request: tokenizer_pb2.EncodeRequest) -> tuple[tokenizer_pb2.EncodeResponse, int]:
        size = self._check_text(request.text, "text")
        ids = self.tokenizer.encode(request.text, request.add_bos, request.add_eos)
        return tokenizer_pb2.EncodeResponse(token_ids=ids), size

    async def EncodeBatch(self, request: tokenizer_pb2.EncodeBatchRequest,
                          context: grpc.aio.ServicerContext) -> tokenizer_pb2.EncodeBatchResponse:
        threaded = sum(len(item.text) for item in request.requests) > _INLINE_LIMIT
        with self.work.call(encodes=True):
            return await self._unary("EncodeBatch", lambda: self._encode_batch(request), threaded)

    def _encode_batch(self, request: tokenizer_pb2.EncodeBatchRequest) -> tuple[tokenizer_pb2.EncodeBatchResponse, int]:
        count = len(request.requests)
        if count > self.limits.max_batch:
            raise TokenizerInputError(
                f"requests has {count} texts; the limit is {self.limits.max_batch} (--max-batch): split the batch",
                "requests")
        size = sum(self._check_text(item.text, f"requests[{i}].text") for i, item in enumerate(request.requests))
        responses = [
            tokenizer_pb2.EncodeResponse(token_ids=self.tokenizer.encode(item.text, item.add_bos, item.add_eos))
            for item in request.requests
        ]
        return tokenizer_pb2.EncodeBatchResponse(responses=responses), size

    async def Decode(self, request: tokenizer_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> tokenizer_pb2.DecodeResponse:
        threaded = len(request.token_ids) > _INLINE_LIMIT
        with self.work.call():
            return await self._unary("Decode", lambda: self._decode(request), threaded)

    def _decode(self, request: tokenizer_pb2.DecodeRequest) -> tuple[tokenizer_pb2.DecodeResponse, int]:
        ids = list(request.token_ids)
        self._check_id_count(len(ids), "token_ids")
        return tokenizer_pb2.DecodeResponse(text=self.tokenizer.decode(ids)), len(ids)

    async def DecodeStream(self, request_iterator: AsyncIterator[tokenizer_pb2.DecodeStreamRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[tokenizer_pb2.DecodeStreamResponse]:
        with self.work.call():
            async for response in self._decode_stream(request_iterator):
                yield response

    async def _decode_stream(self, request_iterator: AsyncIterator[tokenizer_pb2.DecodeStreamRequest]
                             ) -> AsyncIterator[tokenizer_pb2.DecodeStreamResponse]:
        started = time.perf_counter()
        decoder = self.tokenizer.stream_decoder()
        tokens = 0
        try:
            async for request in request_iterator:
                yield self._decode_step(decoder, request)
                tokens += len(request.token_ids)
            if decoder.pending:
                yield tokenizer_pb2.DecodeStreamResponse(text=decoder.flush())
        except Exception as err:
            self._log_done("DecodeStream", _code(err), started, tokens=tokens)
            raise
        self._log_done("DecodeStream", grpc.StatusCode.OK, started, tokens=tokens)

    def _decode_step(self, decoder: StreamDecoder,
                     request: tokenizer_pb2.DecodeStreamRequest) -> tokenizer_pb2.DecodeStreamResponse:
        """One DecodeStream message: prime with its prompt ids, then its tokens (and their alternatives)."""
        ids = list(request.token_ids)
        self._check_id_count(len(ids), "token_ids")
        if request.prompt_ids:
            self._check_id_count(len(request.prompt_ids), "prompt_ids")
            decoder.prime(list(request.prompt_ids))
        if not request.alternatives:
            texts = decoder.push_many(ids)
            return tokenizer_pb2.DecodeStreamResponse(text="".join(texts), token_texts=texts)
        self._check_id_count(sum(len(a.token_ids) for a in request.alternatives), "alternatives")
        texts, others = decoder.push_with_alternatives(ids, [list(a.token_ids) for a in request.alternatives])
        return tokenizer_pb2.DecodeStreamResponse(
            text="".join(texts), token_texts=texts,
            alternative_texts=[tokenizer_pb2.AlternativeTexts(texts=t) for t in others])

    def _piece_messages(self) -> list[tokenizer_pb2.GetPiecesResponse]:
        return piece_messages(self.tokenizer.piece_table(), self.tokenizer.sha256)

    async def GetPieces(self, request: tokenizer_pb2.GetPiecesRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[tokenizer_pb2.GetPiecesResponse]:
        started = time.perf_counter()
        if self._pieces is None or (self._pieces.done() and self._pieces.exception() is not None):
            # Built once, in a thread: measuring every surface takes ~0.6 s for the Grok-1 vocabulary.
            self._pieces = asyncio.ensure_future(asyncio.to_thread(self._piece_messages))
        for message in await asyncio.shield(self._pieces):
            yield message
        self._log_done("GetPieces", grpc.StatusCode.OK, started, pieces=self.tokenizer.vocab_size)

    async def GetInfo(self, request: tokenizer_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> tokenizer_pb2.GetInfoResponse:
        info = self.tokenizer.info()
        reply = tokenizer_pb2.GetInfoResponse(
            vocab_size=info.vocab_size, bos_id=info.bos_id, eos_id=info.eos_id, pad_id=info.pad_id,
            unk_id=info.unk_id, model_sha256=info.model_sha256, model_path=info.model_path,
        )
        return await self._unary("GetInfo", lambda: (reply, 0), threaded=False)

