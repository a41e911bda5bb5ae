"""ASGI middleware that reads a request's body once and refuses, before anything parses it, a body too large
(413) or nested too deeply (400).

Python's json module and pydantic both recurse once per level of nesting: a body of a few thousand `[`
made them raise RecursionError, answered 500. `nesting_depth` counts levels without recursing (strings
removed by one regular expression, then one pass over the brackets), so every depth gets the same 400.
The body is then handed to the app as one message; later receives (a disconnect) pass through.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import ApiError

MAX_BODY_BYTES = 4 << 20  # as gRPC's default receive limit; prompts are capped far lower (--max-prompt-bytes)
# Far above any request's own structure (a JSON schema nests a few levels per level of its data), far below
# the ~1,000 levels where Python's recursion limit is.
MAX_NESTING = 64

STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.S)  # a JSON string (possessive: no backtracking)
BRACKETS = re.compile(rb"[\[\]{}]")


def nesting_depth(body: bytes, stop_at: int | None = None) -> int:
    """How many arrays/objects deep `body` (JSON text) nests, brackets inside strings aside; with `stop_at`, the
    count stops at the first level past it (enough to refuse)."""
    depth = deepest = 0
    for bracket in BRACKETS.finditer(STRING.sub(b'""', body)):
        if bracket.group() in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_at is not None and deepest > stop_at:
                    break
        else:
            depth -= 1
    return deepest


def too_deep(body: bytes, limit: int = MAX_NESTING) -> int | None:
    """The depth (counted to limit + 1) of a body nested deeper than `limit`, else None. A body with no more
    brackets than the limit cannot be: it is not scanned."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return None
    depth = nesting_depth(body, stop_at=limit)
    return depth if depth > limit else None


class BodyChecks:
    """Reads the body (413 once it passes `limit` bytes, declared or sent), refuses one nested deeper than
    MAX_NESTING with 400, then runs the app on it."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body is over {self.limit} bytes; send a shorter prompt")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await self._too_large().response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, last = 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body was whole
                last = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:  # a chunked body without content-length
                await self._too_large().response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if (depth := too_deep(body)) is not None:
            await ApiError(400, f"the request body nests arrays or objects more than {MAX_NESTING} levels deep "
                                f"(at least {depth}); send a flatter body", param="body").response()(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return last or {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
