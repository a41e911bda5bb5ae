"""Channels to the tokenizer service (deadlines, retries, the detokenizer) and what the model replicas' channels
share with them (deadlines, channel options); the replicas themselves are gateway.model_pool.

Each model address gets its own channel with gRPC's round_robin policy, so one DNS name that resolves
to several replicas (docker compose --scale) is spread by gRPC itself; across the listed addresses the
gateway picks the replica with the fewest requests in flight, preferring those whose health is
SERVING, and moves on to the next one when a replica answers UNAVAILABLE before its first token.
Requests to a replica ride on its GenerateMany streams (gateway.model_streams: a step's tokens for all of
them in one message); with `streams=0`, or to a replica that does not implement GenerateMany (an older
version), each request is its own Generate call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence

import grpc

from gateway.detokenize import Decoded, bad_table, piece_table
from gateway.errors import GatewayError, from_finished_call, from_upstream
from serving_common.tls import ChannelTLS, secure_channel
from grok.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from serving_common.detokenizer import PieceTable

log = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str]]

CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.lb_policy_name", "round_robin"),
    # Reconnect quickly to a dependency that restarts (defaults back off to minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
# A GenerateMany message carries a step of every request on the stream (with alternatives and scored prompts,
# megabytes at 64 streams): gRPC's default 4 MiB receive limit would end the stream, and every request on it.
MODEL_CHANNEL_OPTIONS = (*CHANNEL_OPTIONS, ("grpc.max_receive_message_length", 1 << 30))

# How long fetching the piece table may take, whatever the deadline of the request that needed it
# first (later requests use it too): the Grok-1 vocabulary is ~1.5 MB, built in ~0.6 s the first time.
PIECES_TIMEOUT_SECONDS = 60.0


def remaining(deadline: float | None) -> float | None:
    """Seconds left until the monotonic `deadline` (None: no deadline); DEADLINE_EXCEEDED when none."""
    if deadline is None:
        return None
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
    return left


def decode_request(token_ids: Sequence[int], alternatives: Sequence[Sequence[int]],
                   prompt_ids: Sequence[int] = ()) -> tokenizer_pb2.DecodeStreamRequest:
    return tokenizer_pb2.DecodeStreamRequest(
        token_ids=token_ids, prompt_ids=prompt_ids,
        alternatives=[tokenizer_pb2.AlternativeIds(token_ids=ids) for ids in alternatives])


def alternative_texts(reply: tokenizer_pb2.DecodeStreamResponse,
                      alternatives: Sequence[Sequence[int]]) -> list[list[str]] | None:
    """The reply's texts of the alternatives asked for; None when it has none that fit (an older service)."""
    texts = [list(a.texts) for a in reply.alternative_texts]
    if not alternatives or [len(t) for t in texts] != [len(a) for a in alternatives]:
        return None
    return texts


class Detokenizer:
    """One DecodeStream call: token ids in, text that became final out (held bytes are never split).
    The prompt's ids go with the first message, so that the tokens read as they do after the prompt."""

    def __init__(self, call: grpc.aio.StreamStreamCall, address: str, prompt_ids: Sequence[int] = ()) -> None:
        self.call = call
        self.address = address
        self.prompt_ids = prompt_ids

    async def push(self, token_ids: Sequence[int], alternatives: Sequence[Sequence[int]] = ()) -> Decoded:
        """Send ids (and their alternatives); return the new text, each id's part, the alternatives' texts."""
        request = decode_request(token_ids, alternatives, self.prompt_ids)
        self.prompt_ids = ()
        try:
            await self.call.write(request)
            reply = await self.call.read()
        except grpc.aio.AioRpcError as error:
            raise from_upstream(error, "tokenizer", self.address) from error
        except asyncio.InvalidStateError:
            # The call ended while we were not reading (the tokenizer went away between tokens).
            raise await from_finished_call(self.call, "tokenizer", self.address) from None
        if reply is grpc.aio.EOF:
            raise await from_finished_call(self.call, "tokenizer", self.address)
        texts = list(reply.token_texts)
        if len(texts) != len(token_ids):
            texts = [""] * (len(token_ids) - 1) + [reply.text] if token_ids else []
        return Decoded(reply.text, texts, alternative_texts(reply, alternatives))

    async def finish(self) -> str:
        """Half-close and return the flushed remainder (bytes of an incomplete character, decoded)."""
        try:
            await self.call.done_writing()
            reply = await self.call.read()
        except grpc.aio.AioRpcError as error:
            raise from_upstream(error, "tokenizer", self.address) from error
        except asyncio.InvalidStateError:
            raise await from_finished_call(self.call, "tokenizer", self.address) from None
        return "" if reply is grpc.aio.EOF else reply.text

    def cancel(self) -> None:
        self.call.cancel()


def _log_failed_fetch(task: asyncio.Task[PieceTable]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("fetching the piece table failed", extra={"error": str(task.exception())})


class TokenizerClient:
    """Calls to the tokenizer service, with retries on UNAVAILABLE and a cache of single-piece texts."""

    def __init__(self, address: str, retries: int = 2, tls: ChannelTLS | None = None,
                 prefetch_pieces: bool = False) -> None:
        self.address = address
        self.retries = retries
        # With --detokenize local the table is fetched as soon as the service is up, so that no request
        # waits for it (~1 s for the Grok-1 vocabulary: ~0.9 s to build in the service, 0.2 s to read here).
        self.prefetch_pieces = prefetch_pieces
        self.channel = secure_channel(address, tls, CHANNEL_OPTIONS)
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel)
        self.pieces: dict[int, str] = {}
        self._table: asyncio.Task[PieceTable] | None = None

    async def _unary(self, method: str, request: object, deadline: float | None, metadata: Metadata) -> object:
        for attempt in itertools.count():
            try:
                call = getattr(self.stub, method)
                return await call(request, timeout=remaining(deadline), metadata=metadata)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
                    raise from_upstream(error, "tokenizer", self.address) from error
                await asyncio.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    async def encode(self, text: str, deadline: float | None, metadata: Metadata = ()) -> list[int]:
        reply = await self._unary("Encode", tokenizer_pb2.EncodeRequest(text=text), deadline, metadata)
        return list(reply.token_ids)  # type: ignore[attr-defined]

    async def decode(self, ids: Sequence[int], deadline: float | None, metadata: Metadata = ()) -> str:
        reply = await self._unary("Decode", tokenizer_pb2.DecodeRequest(token_ids=ids), deadline, metadata)
        return reply.text  # type: ignore[attr-defined]

    async def info(self, deadline: float | None) -> tokenizer_pb2.GetInfoResponse:
        return await self._unary("GetInfo", tokenizer_pb2.GetInfoRequest(), deadline, ())  # type: ignore[return-value]

    async def piece_texts(self, ids: Sequence[int], deadline: float | None, metadata: Metadata = ()) -> dict[int, str]:
        """Each id's piece decoded on its own (cached: the vocabulary is fixed)."""
        missing = sorted({i for i in ids if i not in self.pieces})
        replies = await asyncio.gather(*(
            self._unary("Decode", tokenizer_pb2.DecodeRequest(token_ids=[i]), deadline, metadata) for i in missing))
        for token_id, reply in zip(missing, replies):
            self.pieces[token_id] = reply.text  # type: ignore[attr-defined]
        return {i: self.pieces[i] for i in ids}

    async def piece_table(self, deadline: float | None) -> PieceTable:
        """The vocabulary's piece table: fetched once, shared by every request, fetched again after
        `forget_piece_table()` or a failed fetch. A request waits for it only until its own deadline."""
        task = self._table
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            return task.result()
        if task is None or task.done():
            task = self._start_fetch()
        try:
            return await asyncio.wait_for(asyncio.shield(task), remaining(deadline))
        except asyncio.TimeoutError:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed") from None

    def forget_piece_table(self) -> None:
        """The tokenizer service (re)started, maybe with another model: drop what came from the old one
        and, when prefetching, fetch the table again now (in the event loop). A fetch still running is
        left to finish for the requests already waiting on it."""
        self._table = None
        self.pieces.clear()
        if self.prefetch_pieces:
            self._start_fetch()

    def _start_fetch(self) -> asyncio.Task[PieceTable]:
        task = self._table = asyncio.create_task(self._fetch_piece_table())
        # A failure nobody awaited is only logged; the next request that needs the table fetches again.
        task.add_done_callback(_log_failed_fetch)
        return task

    async def _fetch_piece_table(self) -> PieceTable:
        for attempt in itertools.count():
            try:
                call = self.stub.GetPieces(tokenizer_pb2.GetPiecesRequest(), timeout=PIECES_TIMEOUT_SECONDS)
                return piece_table([chunk async for chunk in call])
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise bad_table("it does not implement GetPieces: an older version?") from error
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
                    raise from_upstream(error, "tokenizer", self.address) from error
                await asyncio.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    def detokenizer(self, deadline: float | None, metadata: Metadata = (),
                    prompt_ids: Sequence[int] = ()) -> Detokenizer:
        return Detokenizer(self.stub.DecodeStream(timeout=remaining(deadline), metadata=metadata), self.address,
                           prompt_ids)

    async def texts_in_context(self, ids: Sequence[int], alternatives: Sequence[Sequence[int]],
                               deadline: float | None, metadata: Metadata = ()) -> tuple[list[str], list[list[str]]]:
        """Each id's text after the ids before it (a scored prompt) and its alternatives' texts in its place:
        one DecodeStream of `ids` alone (an older service that gives no alternatives' texts: each alone)."""
        call = self.stub.DecodeStream(iter([decode_request(ids, alternatives)]), timeout=remaining(deadline),
                                      metadata=metadata)
        try:
            replies = [reply async for reply in call]
        except grpc.aio.AioRpcError as error:
            raise from_upstream(error, "tokenizer", self.address) from error
        texts = list(replies[0].token_texts) if replies else []
        if len(texts) != len(ids):
            raise GatewayError(grpc.StatusCode.INTERNAL, f"the tokenizer service answered {len(texts)} texts "
                               f"for {len(ids)} ids")
        if texts and len(replies) > 1:
            texts[-1] += "".join(r.text for r in replies[1:])  # the flush of bytes held back at the end
        others = alternative_texts(replies[0], alternatives)
        if others is None:
            alone = await self.piece_texts([i for a in alternatives for i in a], deadline, metadata)
            others = [[alone[i] for i in a] for a in alternatives]
        return texts, others

    async def close(self) -> None:
        if self._table is not None:
            self._table.cancel()
        await self.channel.close()
