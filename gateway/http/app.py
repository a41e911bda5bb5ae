"""The FastAPI application: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, and
vLLM's extras (extras.py).

Each generation request becomes the gateway's GenerateRequest (mapping.py) and runs through the
gRPC API's Pipeline (flow.py). Errors found before the first token get their HTTP status and OpenAI's
error body; a stream that fails later ends with an error event, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.telemetry import TelemetryConfig
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.auth import ApiKeys, tenant_of, tenant_var
from gateway.errors import GatewayError
from gateway.http.access import AccessLog, access_of
from gateway.http.body import MAX_BODY_BYTES, BodyChecks
from gateway.http.chat import chat_prompt
from gateway.http.context import HttpContext
from gateway.http.extras import ExtraRoutes, check_model
from gateway.http.errors import ApiError, from_gateway
from gateway.http.flow import ClientGone, guarded, merged, request_span, tracked
from gateway.http.mapping import (completion_prompts, generate_request, ignored_fields, ignored_warning,
                                  top_logprobs)
from gateway.http.responses import Json, Shaper
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.http.structured import name_constraint_param
from gateway.pipeline import join_responses
from gateway.stream_buffer import bounded
from grok.gateway.v1 import gateway_pb2
from serving_common.logs import new_request_id, request_id_too_long, request_id_var


def sse(data: Json | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """Pydantic's complaint as OpenAI's 400 (FastAPI's default would be a 422 in its own shape); a body that
    is not JSON, or not sent as JSON, says so and what to do."""
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request body"}
    if first.get("type") == "json_invalid":
        return invalid_json(first, error.body).response()
    content_type = request.headers.get("content-type", "")
    if first.get("loc") == ("body",) and content_type and not is_json(content_type):
        return ApiError(400, f"the body was sent as {content_type!r}: send it as JSON with the header "
                             "'Content-Type: application/json'", param="body").response()
    if first.get("loc") == ("body",):  # no body, or JSON that is not an object
        return ApiError(400, f"the request body must be one JSON object: {first.get('msg')}", param="body").response()
    param = field_path(first.get("loc", ()))
    # A field of several types fails once per type: say them all ("stop: Input should be a valid string; Input
    # should be a valid list").
    reasons = list(dict.fromkeys(str(e.get("msg")) for e in error.errors() if field_path(e.get("loc", ())) == param))
    message = f"{param}: {'; '.join(reasons)}" if param else str(first.get("msg"))
    return ApiError(400, message, param=param).response()


UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|[\w.]+\[.*\])$", re.IGNORECASE)


def field_path(loc: Sequence[Any]) -> str | None:
    """The dotted field of a pydantic error location, without the body prefix and from the first union member tag
    on (pydantic names the member it tried: ("stop", "list[str]") is the field `stop`)."""
    path: list[str] = []
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, str) and UNION_MEMBER.match(part):
            break
        path.append(str(part))
    return ".".join(path) or None


def is_json(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def invalid_json(error: Any, body: object) -> ApiError:
    """400 for a body that does not parse, with the line and column (FastAPI gives a character offset)."""
    loc = error.get("loc", ())
    position = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    reason = (error.get("ctx") or {}).get("error", "JSON decode error")
    where = ""
    if position is not None and isinstance(body, str):
        line = body.count("\n", 0, position) + 1
        column = position - body.rfind("\n", 0, position)
        where = f" at line {line}, column {column}"
    return ApiError(400, f"the request body is not valid JSON: {reason}{where}; send one JSON object",
                    param="body")


def internal_error(request_id: str = "") -> ApiError:
    where = f" (request id {request_id})" if request_id else ""
    return ApiError(500, f"internal error{where}; see the gateway's logs", "server_error")


def http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's routing errors (and 413s raised mid-body) as OpenAI's error body; an unknown path or
    method lists the routes this server has."""
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = str(error.detail)
    if error.status_code in (404, 405):
        routes = route_list(request)
        asked = f"{request.method} {request.url.path}"
        message = (f"{asked} is not a route of this server; it has {routes}" if error.status_code == 404 else
                   f"{asked}: method not allowed; this server has {routes}")
    return ApiError(error.status_code, message, kind).response()


def route_list(request: Request) -> str:
    """'GET /health, POST /v1/completions, ...': every route of the app, by method."""
    routes = [(method, route.path) for route in request.app.routes if isinstance(route, APIRoute)
              for method in sorted(route.methods or ())]
    return ", ".join(f"{method} {path}" for method, path in routes)


class RequireKey:
    """ASGI middleware: every path but /health needs `Authorization: Bearer KEY` when keys are set.

    Checked before the body is read or parsed, so a caller without a key learns nothing else."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS
                and not self.keys.allows(Headers(scope=scope).get("authorization"))):
            refused = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                               code="invalid_api_key")
            await refused.response()(scope, receive, send)
            return
        if scope["type"] == "http" and self.keys.enabled:  # prefix-cache isolation per key (gateway/auth.py)
            tenant_var.set(tenant_of(Headers(scope=scope).get("authorization")))
        await self.app(scope, receive, send)


class AbsoluteForm:
    """ASGI middleware: a request target in absolute form (`POST http://host/v1/completions HTTP/1.1`, RFC 9112
    3.2.2, which a server must accept) is routed by its path, its authority taking the Host header's place.
    (uvicorn hands the whole URL over as the path: it answered 404.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and ABSOLUTE.match(scope["path"]):
            scope = absolute_to_origin(scope)
        await self.app(scope, receive, send)


ABSOLUTE = re.compile(r"^https?://", re.IGNORECASE)


def absolute_to_origin(scope: Scope) -> Scope:
    """The scope of an absolute-form request as if its target were in origin form (path and query)."""
    raw = bytes(scope.get("raw_path") or scope["path"].encode())
    parts = urlsplit(raw.decode("latin-1"))
    path = parts.path or "/"
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"host"] + [(b"host", parts.netloc.encode())]
    query = parts.query.encode("latin-1") or scope.get("query_string", b"")
    return {**scope, "path": unquote(path), "raw_path": path.encode("latin-1"), "query_string": query,
            "headers": headers}


class Routes:
    """Route handlers bound to one gateway's context."""

    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx

    def check_model(self, model: str | None) -> None:
        check_model(self.ctx.model_name, model)

    async def health(self) -> JSONResponse:
        serving = self.ctx.health.serving
        return JSONResponse({"status": "SERVING" if serving else "NOT_SERVING"}, status_code=200 if serving else 503)

    async def models(self) -> Json:
        return {"object": "list", "data": [await self.ctx.model_card()]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        return await self.respond(request, "completions", body,
                                  [generate_request(body, prompt) for prompt in completion_prompts(body)])

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        prompt = chat_prompt(self.ctx.template, body)
        return await self.respond(request, "chat", body, [generate_request(body, prompt)],
                                  continues=body.continue_final_message)

    async def respond(self, request: Request, endpoint: str, body: SamplingFields,
                      grpc_requests: list[gateway_pb2.GenerateRequest], continues: bool = False) -> Response:
        """One response for the request's prompts (completions may send several: each runs as a request of its
        own, their choices follow in the prompts' order). `continues`: the prompt ends inside the answer's own
        text (continue_final_message), so the answer's first space is its content, not the separator after the
        template's "Assistant:"."""
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: only allowed with stream: true", param="stream_options")
        given = request.headers.get("x-request-id", "")
        if (problem := request_id_too_long(given)) is not None:
            raise ApiError(400, f"x-request-id: {problem}", param="x-request-id")
        request_id = new_request_id(given=given)  # a fresh one when not printable ASCII
        request_id_var.set(request_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ctx.timeout_seconds if self.ctx.timeout_seconds else None
        method = "http_chat_completions" if endpoint == "chat" else "http_completions"
        span = request_span(request_id, self.ctx.model_name)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = include_usage and body.stream_options.continuous_usage_stats  # type: ignore[union-attr]
        sampling = grpc_requests[0].sampling
        n = sampling.n or 1
        access = access_of(request.scope)
        access.request_id = request_id  # one access line for the request, whatever its number of prompts
        streams = [tracked(self.ctx.pipeline, grpc_request, deadline,
                           request_id if len(grpc_requests) == 1 else f"{request_id}-{i}", method, span,
                           chat=endpoint == "chat" and not continues, access=access, running_usage=continuous,
                           turn_starts=self.ctx.template.turn_starts if endpoint == "chat" else ())
                   for i, grpc_request in enumerate(grpc_requests)]
        # bounded: read ahead (at most its bytes) and join what queued up while an event was being written, so
        # that a stream that fell behind catches up in fewer, longer events, as the gRPC API's do.
        source = guarded(request, bounded(merged(streams, n), join=join_responses))
        shaper = Shaper(endpoint, request_id, self.ctx.model_name, top_logprobs(body), echo=sampling.echo,
                        prompt_logprobs=body.prompt_logprobs is not None, continuous_usage=continuous, n=n,
                        token_ids=body.return_tokens_as_token_ids)
        headers = {"x-request-id": request_id, **self.ignored(body)}
        try:
            first = await anext(source)  # errors before the first text still get their HTTP status
            if not body.stream:
                messages = [first] + [m async for m in source]
                return JSONResponse(shaper.whole(messages), headers=headers)
        except GatewayError as error:
            await source.aclose()
            return name_constraint_param(from_gateway(error, endpoint), body).response()
        except ClientGone:
            return Response(status_code=499)
        except StopAsyncIteration:  # the pipeline always ends with a message; a bug if not
            return internal_error(request_id).response()
        events = self.events(shaper, first, source, include_usage, endpoint, n)
        return StreamingResponse(events,
                                 media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})

    @staticmethod
    def ignored(body: SamplingFields) -> dict[str, str]:
        """Fields of the body that neither API has: logged (as vLLM logs them) and named in a Warning header."""
        if not (ignored := ignored_fields(body)):
            return {}
        logging.getLogger("gateway.http").warning(
            f"The following fields were present in the request but ignored: {sorted(ignored)}",
            extra={"ignored_fields": sorted(ignored), "did_you_mean": {k: v for k, v in ignored.items() if v}})
        return {"warning": ignored_warning(ignored)}

    async def events(self, shaper: Shaper, first: gateway_pb2.GenerateResponse,
                     source: AsyncIterator[gateway_pb2.GenerateResponse], include_usage: bool,
                     endpoint: str, n: int) -> AsyncIterator[bytes]:
        """The SSE body: (chat) the role chunk, one chunk per message (each names its choice index), finishes,
        usage, [DONE]."""
        lasts = []
        try:
            if endpoint == "chat":
                yield sse(shaper.role_chunk(include_usage, n, first.usage.prompt_tokens))
            for chunk in shaper.chunks(first, include_usage):
                yield sse(chunk)
            lasts += [first] if first.finish_reason else []
            async for message in source:  # to its end, so the request is counted as finished, not cancelled
                for chunk in shaper.chunks(message, include_usage):
                    yield sse(chunk)
                lasts += [message] if message.finish_reason else []
            if include_usage:
                yield sse(shaper.usage_chunk(lasts))
        except GatewayError as error:
            yield sse(from_gateway(error, endpoint).body())
        except ClientGone:
            return
        finally:
            await source.aclose()  # type: ignore[attr-defined]
        yield sse("[DONE]")


# FastAPI's native OpenTelemetry spans, on when --otlp-endpoint installed a tracer provider: one server span
# per request (under the client's traceparent) that the pipeline's spans hang from. No spans for its
# internal steps (the pipeline's `validate` covers the request's checks) nor for health probes; no
# exporters of its own from environment variables: --otlp-endpoint is the one switch.
TELEMETRY: TelemetryConfig = {"operation_spans": False, "auto_configure": False,
                              "exclude": lambda scope: scope.get("path") == "/health"}


def create_app(ctx: HttpContext) -> FastAPI:
    """The OpenAI-compatible app; every route but /health needs the API key when keys are set."""
    app = FastAPI(title="grok-serve", description="OpenAI-compatible API of the grok-serve gateway",
                  docs_url=None, redoc_url=None, telemetry=TELEMETRY)
    routes = Routes(ctx)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    ExtraRoutes(ctx).register(app)  # vLLM's: /v1/models/{id}, /tokenize, /detokenize, /version, /metrics
    # Added last = outermost: the key is checked before the body is read.
    app.add_middleware(BodyChecks, limit=MAX_BODY_BYTES)  # size and nesting, before anything parses the body
    if ctx.keys.enabled:
        app.add_middleware(RequireKey, keys=ctx.keys)
    app.add_middleware(AbsoluteForm)  # before the key's path check and routing
    app.add_middleware(AccessLog)  # outermost: refusals by the middlewares above get their line too
    app.add_exception_handler(ApiError, lambda _request, error: error.response())  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    # A bug still answers OpenAI's error body (Starlette logs the traceback and keeps serving).
    app.add_exception_handler(Exception, lambda _r, _e: internal_error(request_id_var.get("")).response())
    return app
