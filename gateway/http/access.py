"""One access line per HTTP request: method, path, status, token counts, finish reason, duration.

`AccessLog` is the outermost ASGI middleware: it puts an `Access` record in the request's state, which the
generation routes fill (the pipeline's token counts and finish), and logs the record once the response is
sent, streams included. Health and metrics probes are logged at debug level only: they arrive every few
seconds and say nothing about requests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("gateway.access")

QUIET_PATHS = frozenset({"/health", "/metrics"})


@dataclass
class Access:
    """What a route knows about its request, for the access line."""

    request_id: str = ""
    code: str = ""  # the pipeline's outcome (gRPC status name), when a generation ran
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str = ""
    detail: str = ""  # an error's message

    def generated(self, request_id: str, code: str, detail: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int) -> None:
        """One generation's outcome. A completion request of several prompts runs one each: their tokens add up,
        the first failure (else the first outcome) is the request's, the request id is the first one given."""
        if not self.code or (self.code == "OK" and code != "OK"):
            self.code, self.detail = code, detail
        self.request_id = self.request_id or request_id
        self.finish_reason = self.finish_reason or finish_reason
        self.prompt_tokens = (self.prompt_tokens or 0) + prompt_tokens or None
        self.completion_tokens = (self.completion_tokens or 0) + completion_tokens or None


def access_of(scope: Scope) -> Access:
    """The request's record (a fresh one when the middleware is not installed, e.g. in unit tests)."""
    state = scope.setdefault("state", {})
    return state.setdefault("access", Access())


class AccessLog:
    """ASGI middleware logging one line per request after its response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = access_of(scope)
        started = time.perf_counter()
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            fields = {"http_method": scope.get("method", ""), "path": scope.get("path", ""),
                      "status": status or 499, "ms": round((time.perf_counter() - started) * 1000, 3)}
            if record.request_id:
                fields["request_id"] = record.request_id
            for name in ("code", "prompt_tokens", "completion_tokens", "finish_reason", "detail"):
                value = getattr(record, name)
                if value not in ("", None):
                    fields[name] = value
            level = logging.DEBUG if scope.get("path") in QUIET_PATHS and status == 200 else logging.INFO
            log.log(level, "request", extra=fields)
