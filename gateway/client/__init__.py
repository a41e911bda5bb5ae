"""A small client for GatewayService over the generated stubs: `GatewayClient` (sync), `AsyncGatewayClient`.

    with GatewayClient("127.0.0.1:50051") as client:
        for message in client.generate("Hello", max_tokens=16):
            print(message.text, end="", flush=True)

`address` is any gRPC target: HOST:PORT, or `unix:PATH` for a gateway started with `--uds PATH`.
Errors surface as grpc.RpcError with the gateway's status code and message. `request_id` is sent as
the `x-request-id` metadata the services log (one is generated when it is empty). `api_key` is sent
as `authorization: Bearer KEY` (gateways started with --api-key); `tls_ca` (a PEM CA file) makes the
channel TLS, verifying the gateway's certificate.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc

from grok.gateway.v1 import gateway_pb2, gateway_pb2_grpc

__all__ = ["AsyncGatewayClient", "GatewayClient", "chat_request", "completion_request", "generate_request",
           "sampling_params"]


def _metadata(request_id: str, api_key: str | None = None) -> tuple[tuple[str, str], ...]:
    auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return ((("x-request-id", request_id),) if request_id else ()) + auth


def _credentials(tls_ca: str | None) -> grpc.ChannelCredentials | None:
    return grpc.ssl_channel_credentials(pathlib.Path(tls_ca).read_bytes()) if tls_ca else None


def sampling_params(**options: Any) -> gateway_pb2.SamplingParams:
    """SamplingParams from its fields by name (max_tokens=16, top_k=40, logit_bias={5: -100}, ...); a None value
    leaves the field unset (the server's default)."""
    return gateway_pb2.SamplingParams(**{name: value for name, value in options.items() if value is not None})


def generate_request(prompt: str, **options: Any) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest for `prompt` with the SamplingParams fields in `options`."""
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=sampling_params(**options))


def completion_request(prompt: str, **options: Any) -> gateway_pb2.CompleteRequest:
    """A CompleteRequest with the same options as generate_request (the messages share SamplingParams)."""
    return gateway_pb2.CompleteRequest(prompt=prompt, sampling=sampling_params(**options))


def chat_request(messages: Sequence[Mapping[str, str]], **options: Any) -> gateway_pb2.ChatRequest:
    """A ChatRequest for `messages` ({"role": ..., "content": ...} each) with the SamplingParams fields in `options`."""
    return gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(**m) for m in messages],
                                   sampling=sampling_params(**options))


class GatewayClient:
    """Blocking client. Leaving `generate`'s iterator early cancels the call (the model slot is freed)."""

    def __init__(self, address: str, timeout: float | None = None, api_key: str | None = None,
                 tls_ca: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.api_key = api_key
        credentials = _credentials(tls_ca)
        self.channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    def generate(self, prompt: str, *, timeout: float | None = None, request_id: str = "",
                 **options: Any) -> Iterator[gateway_pb2.GenerateResponse]:
        call = self.stub.Generate(generate_request(prompt, **options), timeout=timeout or self.timeout,
                                  metadata=_metadata(request_id, self.api_key))
        try:
            yield from call
        finally:
            call.cancel()

    def chat(self, messages: Sequence[Mapping[str, str]], *, timeout: float | None = None, request_id: str = "",
             **options: Any) -> Iterator[gateway_pb2.ChatResponse]:
        """Stream the answer to a conversation (rendered by the gateway's chat template)."""
        call = self.stub.Chat(chat_request(messages, **options), timeout=timeout or self.timeout,
                              metadata=_metadata(request_id, self.api_key))
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str, *, timeout: float | None = None, request_id: str = "",
                 **options: Any) -> gateway_pb2.CompleteResponse:
        return self.stub.Complete(completion_request(prompt, **options), timeout=timeout or self.timeout,
                                  metadata=_metadata(request_id, self.api_key))

    def info(self, timeout: float | None = None) -> gateway_pb2.GetInfoResponse:
        return self.stub.GetInfo(gateway_pb2.GetInfoRequest(), timeout=timeout or self.timeout,
                                 metadata=_metadata("", self.api_key))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGatewayClient:
    """asyncio client (grpc.aio); create it inside the running event loop."""

    def __init__(self, address: str, timeout: float | None = None, api_key: str | None = None,
                 tls_ca: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.api_key = api_key
        credentials = _credentials(tls_ca)
        self.channel = (grpc.aio.secure_channel(address, credentials) if credentials
                        else grpc.aio.insecure_channel(address))
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    async def generate(self, prompt: str, *, timeout: float | None = None, request_id: str = "",
                       **options: Any) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        call = self.stub.Generate(generate_request(prompt, **options), timeout=timeout or self.timeout,
                                  metadata=_metadata(request_id, self.api_key))
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()

    async def complete(self, prompt: str, *, timeout: float | None = None, request_id: str = "",
                       **options: Any) -> gateway_pb2.CompleteResponse:
        return await self.stub.Complete(completion_request(prompt, **options), timeout=timeout or self.timeout,
                                        metadata=_metadata(request_id, self.api_key))

    async def info(self, timeout: float | None = None) -> gateway_pb2.GetInfoResponse:
        return await self.stub.GetInfo(gateway_pb2.GetInfoRequest(), timeout=timeout or self.timeout,
                                       metadata=_metadata("", self.api_key))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncGatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
