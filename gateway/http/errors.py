"""Errors of the HTTP API: OpenAI's error body, and the one table mapping gRPC statuses to HTTP.

Every failure answers `{"error": {"message", "type", "param", "code"}}`. Errors from the pipeline
arrive as GatewayError with a gRPC status and a message that starts with the field it is about
("max_tokens: ..."); the field is reported as `param`, and named in the message, under its OpenAI name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc
from fastapi.responses import JSONResponse

from gateway.errors import GatewayError

# gRPC status -> (HTTP status, OpenAI error type, error code)
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", None),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", None),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
}
INTERNAL = (500, "server_error", None)
# A 429 (queue or KV memory full now) and a 503 (starting, draining, no replica) are for "later": they say when to
# retry (RFC 9110 10.2.3), as a load balancer or an OpenAI client's retry loop reads it. A request that can never
# be served is a 400 instead.
RETRY_AFTER_SECONDS = 1
RETRY_LATER = frozenset({429, 503})

# Field names of the gRPC request whose OpenAI name differs, per endpoint.
PARAM_NAMES = {
    "completions": {"top_logprobs": "logprobs"},
    "chat": {"prompt": "messages"},
}
FIELD = re.compile(r"^([a-z_]+)(\[\d+\])?: ")


@dataclass
class ApiError(Exception):
    """An error answered as OpenAI's error body with `status`."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"www-authenticate": "Bearer"} if self.status == 401 else {}
        if self.status in RETRY_LATER:
            headers["retry-after"] = str(RETRY_AFTER_SECONDS)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(param: str, message: str) -> ApiError:
    """400 about one request field, the message starting with its name (as the gRPC API's do)."""
    return ApiError(400, f"{param}: {message}", param=param)


def from_status(code: grpc.StatusCode, message: str, endpoint: str = "completions") -> ApiError:
    status, kind, error_code = HTTP_STATUS.get(code, INTERNAL)
    param = None
    match = FIELD.match(message)
    if match and status == 400:
        param = PARAM_NAMES.get(endpoint, {}).get(match.group(1), match.group(1))
        # The message names the field as the caller sent it, as `param` does.
        message = param + message[len(match.group(1)):]
    return ApiError(status, message, kind, param, error_code)


def from_gateway(error: GatewayError, endpoint: str = "completions") -> ApiError:
    return from_status(error.code, error.message, endpoint)
