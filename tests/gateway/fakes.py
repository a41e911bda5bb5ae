"""Fake tokenizer and model services whose outputs are computable by hand, for the gateway's tests.

Run as processes: `python -m tests.gateway.fakes tokenizer|model --port P [...]`.

Tokenizer: ids 0..3 are PAD/BOS/EOS/UNK (decode to ""), ids 4..259 are the bytes 0..255, and ids
260.. are the multi-byte PIECES below. Encoding is greedy longest match, falling back to bytes; decoding
is UTF-8 with replacement, and DecodeStream uses Python's incremental UTF-8 decoder.

Model: the continuation of a prompt is the prompt's tokens after its first "|" byte (the whole prompt if
it has none), repeated until max_tokens; EOS follows each pass unless ignore_eos. Each token waits
--delay seconds; --group K sends up to K tokens per message (as a speculative step does). --slots bounds concurrent requests (the rest get RESOURCE_EXHAUSTED). Every request
logs "request done" with its `outcome`: "finished" once its last token was sent, "cancelled" when the
caller cancelled it (or its deadline passed) before that. Tests read these lines.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import logging
import math
import sys
from collections.abc import AsyncIterator

import grpc

from grok.model.v1 import model_pb2, model_pb2_grpc
from grok.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from serving_common import logs
from model_service.many import ManyStream
from serving_common.errors import ServiceError
from serving_common.grpc_server import add_health_and_reflection, bind

log = logging.getLogger("fake")

PIECES = ("hello", "wor", "ld", "he", "llo", " the", "é", "ab")
BYTE0 = 4
VOCAB = 512
EOS = 2
CONTEXT = 128
PIPE = BYTE0 + ord("|")
Context = grpc.aio.ServicerContext


def encode(text: str) -> list[int]:
    data, ids, i = text.encode("utf-8"), [], 0
    pieces = sorted(((p.encode("utf-8"), BYTE0 + 256 + k) for k, p in enumerate(PIECES)), key=lambda x: -len(x[0]))
    while i < len(data):
        for piece, token in pieces:
            if data.startswith(piece, i):
                ids.append(token)
                i += len(piece)
                break
        else:
            ids.append(BYTE0 + data[i])
            i += 1
    return ids


def token_bytes(token: int) -> bytes:
    if BYTE0 <= token < BYTE0 + 256:
        return bytes([token - BYTE0])
    if BYTE0 + 256 <= token < BYTE0 + 256 + len(PIECES):
        return PIECES[token - BYTE0 - 256].encode("utf-8")
    return b""


def decode(ids: list[int]) -> str:
    return b"".join(token_bytes(t) for t in ids).decode("utf-8", errors="replace")


def peek(decoder: codecs.IncrementalDecoder, token: int) -> str:
    """The text `token` would add now; the decoder's state is left as it was."""
    state = decoder.getstate()
    try:
        return decoder.decode(token_bytes(token))
    finally:
        decoder.setstate(state)


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, legacy: bool = False) -> None:
        self.legacy = legacy  # as a tokenizer service older than DecodeStream's prompt_ids and alternatives

    async def Encode(self, request: tokenizer_pb2.EncodeRequest, context: Context) -> tokenizer_pb2.EncodeResponse:
        return tokenizer_pb2.EncodeResponse(token_ids=encode(request.text))

    async def Decode(self, request: tokenizer_pb2.DecodeRequest, context: Context) -> tokenizer_pb2.DecodeResponse:
        return tokenizer_pb2.DecodeResponse(text=decode(list(request.token_ids)))

    async def DecodeStream(self, request_iterator: AsyncIterator[tokenizer_pb2.DecodeStreamRequest],
                           context: Context) -> AsyncIterator[tokenizer_pb2.DecodeStreamResponse]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        async for request in request_iterator:
            if self.legacy:
                request = tokenizer_pb2.DecodeStreamRequest(token_ids=request.token_ids)
            for token in request.prompt_ids:  # read as text already returned
                decoder.decode(token_bytes(token))
            texts, others = [], []
            for index, token in enumerate(request.token_ids):
                if request.alternatives:
                    others.append(tokenizer_pb2.AlternativeTexts(texts=[
                        peek(decoder, other) for other in request.alternatives[index].token_ids]))
                texts.append(decoder.decode(token_bytes(token)))
            yield tokenizer_pb2.DecodeStreamResponse(text="".join(texts), token_texts=texts, alternative_texts=others)
        yield tokenizer_pb2.DecodeStreamResponse(text=decoder.decode(b"", final=True))

    async def GetInfo(self, request: tokenizer_pb2.GetInfoRequest, context: Context) -> tokenizer_pb2.GetInfoResponse:
        return tokenizer_pb2.GetInfoResponse(vocab_size=VOCAB, bos_id=1, eos_id=EOS, pad_id=0, unk_id=3)


def continuation(prompt: list[int]) -> list[int]:
    return prompt[prompt.index(PIPE) + 1:] if PIPE in prompt and prompt[-1] != PIPE else prompt


class FakeModel(model_pb2_grpc.ModelServiceServicer):
    """Generate, and GenerateMany over the same requests (model_service.many, as the real service serves it)."""

    def __init__(self, slots: int, delay: float, group: int = 1, legacy: bool = False) -> None:
        self.legacy = legacy  # as an older version: no GenerateMany, and GetInfo does not announce it
        self.free = slots
        self.slots = slots
        self.delay = delay
        self.group = group
        self.draining = asyncio.Event()  # never set: the fake does not drain

    async def Generate(self, request: model_pb2.GenerateRequest,
                       context: Context) -> AsyncIterator[model_pb2.GenerateResponse]:
        try:
            async for reply in self._request(request):
                yield reply
        except ServiceError as error:
            await context.abort(error.code, error.message)

    async def GenerateMany(self, request_iterator: AsyncIterator[model_pb2.GenerateManyRequest],
                           context: Context) -> AsyncIterator[model_pb2.GenerateManyResponse]:
        log.info("many stream opened")
        stream = ManyStream(lambda request, timeout, trace_context: self._request(request), self.draining)
        async for message in stream.messages(request_iterator):
            yield message

    async def _request(self, request: model_pb2.GenerateRequest) -> AsyncIterator[model_pb2.GenerateResponse]:
        if not request.token_ids or len(request.token_ids) + request.max_tokens > CONTEXT:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: over the context")
        if self.free == 0:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: retry later")
        self.free -= 1
        log.info("request started", extra={"rid": request.request_id})
        outcome = "cancelled"
        try:
            async for reply in self._replies(request):
                yield reply
            outcome = "finished"
        finally:
            self.free += 1
            log.info("request done", extra={"outcome": outcome, "rid": request.request_id})

    async def _replies(self, request: model_pb2.GenerateRequest) -> AsyncIterator[model_pb2.GenerateResponse]:
        pattern = continuation(list(request.token_ids)) + ([] if request.ignore_eos else [EOS])
        timings = model_pb2.Timings(queue_seconds=0.001, prefill_seconds=0.002, mean_step_seconds=self.delay)
        ids: list[int] = []
        details: list[model_pb2.Token] = []
        for step in range(request.max_tokens):
            await asyncio.sleep(self.delay)
            token = pattern[step % len(pattern)]
            done = step + 1 == request.max_tokens or token == EOS
            probability = 0.5
            tops = [model_pb2.TopToken(id=(token + k) % VOCAB, probability=probability / (k + 1),
                                       logprob=math.log(probability / (k + 1))) for k in range(request.top_logprobs)]
            ids.append(token)
            details.append(model_pb2.Token(id=token, probability=probability, logprob=math.log(probability),
                                           top_tokens=tops))
            if len(ids) < self.group and not done:
                continue
            yield model_pb2.GenerateResponse(
                token_ids=ids, prompt_tokens=len(request.token_ids), completion_tokens=step + 1, tokens=details,
                finish_reason=(model_pb2.FINISH_REASON_EOS if token == EOS else model_pb2.FINISH_REASON_LENGTH)
                if done else model_pb2.FINISH_REASON_UNSPECIFIED,
                timings=timings if step + 1 == len(ids) or done else None)
            ids, details = [], []
            if done:
                return

    async def GetInfo(self, request: model_pb2.GetInfoRequest, context: Context) -> model_pb2.GetInfoResponse:
        return model_pb2.GetInfoResponse(
            config=model_pb2.ModelConfig(vocab_size=VOCAB, pad_token=0, eos_token=EOS, sequence_len=CONTEXT),
            slots=self.slots, prefill_buckets=[32, 64], dtype="float32", random_weights=True, platform="fake",
            generate_many=not self.legacy)


def add_model(model: FakeModel, server: grpc.aio.Server, legacy: bool) -> None:
    """The fake's ModelService; `legacy`: without GenerateMany, which gRPC then answers UNIMPLEMENTED itself,
    as a model service of an older version does."""
    if not legacy:
        model_pb2_grpc.add_ModelServiceServicer_to_server(model, server)
        return
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            model.Generate, request_deserializer=model_pb2.GenerateRequest.FromString,
            response_serializer=model_pb2.GenerateResponse.SerializeToString),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            model.GetInfo, request_deserializer=model_pb2.GetInfoRequest.FromString,
            response_serializer=model_pb2.GetInfoResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("grok.model.v1.ModelService", handlers),))


async def serve(kind: str, port: int, slots: int, delay: float, legacy: bool, group: int = 1) -> None:
    server = grpc.aio.server()
    if kind == "tokenizer":
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(FakeTokenizer(legacy), server)
        name = "grok.tokenizer.v1.TokenizerService"
    else:
        add_model(FakeModel(slots, delay, group, legacy), server, legacy)
        name = "grok.model.v1.ModelService"
    health = add_health_and_reflection(server, [name])
    bound = bind(server, "127.0.0.1", port)
    await server.start()
    await health.set(True)
    log.info("serving", extra={"port": bound})
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["tokenizer", "model"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--group", type=int, default=1, help="model: tokens per message")
    parser.add_argument("--legacy", action="store_true",
                        help="tokenizer: ignore DecodeStream's newer fields; model: no GenerateMany")
    args = parser.parse_args()
    logs.configure(f"fake-{args.kind}", "info")
    asyncio.run(serve(args.kind, args.port, args.slots, args.delay, args.legacy, args.group))


if __name__ == "__main__":
    main()
    sys.exit(0)
