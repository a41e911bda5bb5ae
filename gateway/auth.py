"""API keys of the gateway: `authorization: Bearer KEY` on gRPC metadata and on HTTP.

Keys come from --api-key (comma-separated) and --api-key-file (one per line; blank lines and
`#` comments skipped), or their GROK_GATEWAY_* variables. With no key configured, every caller is
let in. Checking is constant-time: the presented key is hashed and compared with every configured
key's hash without stopping at a match, so neither timing nor length says how close a guess was.
grpc.health.v1 stays open (load balancers and orchestrators probe it without a key), as do HTTP
/health and the metrics port (operator-only: bind it where tenants cannot reach it, docs/security.md).

Each key is a tenant: a request's `tenant_var` is a digest of the key it presented (never the key), set
where the key is checked, and the model's prefix cache is salted with it (`cache_salt`), so tenants never
share cached prompt blocks, nor learn from a faster prefill what another one sent.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import pathlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/",)
REFUSED = "missing or wrong API key: send the metadata/header 'authorization: Bearer KEY'"
# The calling tenant's identity (tenant_of), for the request being served; b"": no keys configured.
tenant_var: contextvars.ContextVar[bytes] = contextvars.ContextVar("tenant", default=b"")


def load_keys(keys: str | None, key_file: str | None) -> tuple[str, ...]:
    """The configured keys; ValueError naming the flag when the file is unreadable or a key is blank."""
    out = [k.strip() for k in (keys or "").split(",") if k.strip()]
    if key_file:
        try:
            lines = pathlib.Path(key_file).read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise ValueError(f"--api-key-file: cannot read {key_file!r} ({error.strerror or error})") from None
        file_keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not file_keys:
            raise ValueError(f"--api-key-file: {key_file!r} holds no key (one per line)")
        out += file_keys
    if any(any(c.isspace() for c in k) for k in out):
        raise ValueError("--api-key: a key must not contain whitespace")
    return tuple(out)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def tenant_of(authorization: str | None) -> bytes:
    """A caller's tenant identity: a 16-byte digest of the key in its `authorization` value (b"" without one),
    in a hash domain of its own: it says which key, never what the key is."""
    _, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return hashlib.blake2b(token.encode("utf-8"), digest_size=16, person=b"grok-tenant").digest() if token else b""


def cache_salt(tenant: bytes, requested: str | None) -> bytes:
    """The model request's cache_salt: b"" when neither a tenant nor a salt is given (the shared cache), else
    a digest of both (length-prefixed: no two pairs give the same bytes)."""
    if not tenant and requested is None:
        return b""
    salt = requested.encode("utf-8") if requested is not None else b""
    h = hashlib.blake2b(digest_size=16, person=b"grok-cache-salt")
    for part in (tenant, salt, b"\x01" if requested is not None else b"\x00"):
        h.update(len(part).to_bytes(4, "big") + part)
    return h.digest()


class ApiKeys:
    """The accepted keys (stored hashed); `allows` checks an `authorization` value."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """True when no key is configured, or `authorization` is `Bearer <a configured key>`."""
        if not self._digests:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        presented = _digest(token.strip())
        matched = False
        for digest in self._digests:  # no early exit: the time does not depend on which key matched
            matched |= hmac.compare_digest(digest, presented)
        return matched and scheme.lower() == "bearer" and bool(token.strip())

    def allows_metadata(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        return self.allows(authorization_of(metadata))


def authorization_of(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    return next((str(v) for k, v in metadata or () if k == "authorization"), None)


async def _refuse_unary(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


async def _refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
    yield  # pragma: no cover (makes this an async generator, the shape streaming handlers have)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse_unary, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse_stream, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse_unary, **codec)
    return grpc.stream_stream_rpc_method_handler(_refuse_stream, **codec)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but health with UNAUTHENTICATED unless it carries a configured key."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        authorization = authorization_of(details.invocation_metadata)  # type: ignore[arg-type]
        if self.keys.allows(authorization):
            tenant_var.set(tenant_of(authorization))  # the call's task runs its handler after this
            return handler
        return _refusing(handler)
