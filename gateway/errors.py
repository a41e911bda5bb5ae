"""Domain errors of the gateway and the one place that maps upstream gRPC statuses to ours.

Upstream INVALID_ARGUMENT, RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED pass through unchanged; an
unreachable service is UNAVAILABLE naming the service; anything else is INTERNAL (a bug somewhere).
"""

from __future__ import annotations

import grpc

PASS_THROUGH = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
})


class GatewayError(Exception):
    """An error that ends a request with `code` and an actionable `message`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(field: str, problem: str) -> GatewayError:
    """INVALID_ARGUMENT whose message starts with the field name."""
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def from_upstream(error: grpc.RpcError, service: str, address: str) -> GatewayError:
    """Map a failed call to the tokenizer or model service to the gateway's status."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else "") or ""
    if code in PASS_THROUGH:
        return GatewayError(code, f"{service} service: {details}" if details else f"{service} service: {code.name}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return GatewayError(code, f"{service} service at {address} is unavailable ({details}); retry later")
    return GatewayError(grpc.StatusCode.INTERNAL, f"{service} service at {address} failed: {code.name}: {details}")
