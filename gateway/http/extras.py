"""The routes vLLM's server has beside OpenAI's: GET /v1/models/{id}, POST /tokenize, POST /detokenize,
GET /version and GET /metrics (the gateway's Prometheus metrics, the same as on --metrics-port).

/tokenize encodes as a completion's prompt is encoded (Grok-1 prompts carry no special tokens, so
`add_special_tokens` changes nothing), or renders `messages` with the chat template first, exactly as
/v1/chat/completions does; /detokenize is the tokenizer service's Decode. Like every route but /health,
they need the API key when the gateway has one.
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from gateway.config import prompt_byte_limit
from gateway.errors import GatewayError
from gateway.http.chat import chat_prompt
from gateway.http.context import HttpContext
from gateway.http.errors import ApiError, bad_request, from_gateway
from gateway.http.responses import Json
from gateway.http.schemas import ChatMessage


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a `prompt`, or chat `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize body."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def check_model(served: str, model: str | None) -> None:
    """404 unless `model` is unset or the served model's name (as OpenAI answers an unknown model)."""
    if model and model != served:
        raise ApiError(404, f"The model '{model}' does not exist: this server serves '{served}' (GET /v1/models)",
                       param="model", code="model_not_found")


def version() -> str:
    try:
        return metadata.version("grok-serve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


class ExtraRoutes:
    """Handlers of the vLLM-compatible extras, bound to one gateway's context."""

    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])

    def check_model(self, model: str | None) -> None:
        check_model(self.ctx.model_name, model)

    async def model(self, model_id: str) -> Json:
        """The model card, as in /v1/models (the openai package's `models.retrieve`)."""
        self.check_model(model_id)
        return await self.ctx.model_card()

    async def version(self) -> Json:
        return {"version": version()}

    async def metrics(self) -> Response:
        metrics = self.ctx.pipeline.metrics  # the whole deployment's; no prefix-cache figures to key holders
        registry = metrics.tenant_exposition if self.ctx.keys.enabled else metrics.exposition
        return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    def _deadline(self) -> float | None:
        timeout = self.ctx.timeout_seconds
        return asyncio.get_running_loop().time() + timeout if timeout else None

    async def tokenize(self, body: TokenizeRequest, request: Request) -> Json:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt", "send exactly one of prompt (text) and messages (a chat)")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages", "must hold at least one message")
            text = chat_prompt(self.ctx.template, body)
        else:
            text = body.prompt or ""
        deadline = self._deadline()
        pipeline = self.ctx.pipeline
        try:
            limit = prompt_byte_limit(pipeline.limits, (await pipeline.pool.info(deadline)).config.sequence_len)
            if len(text.encode("utf-8")) > limit:
                raise bad_request("prompt", f"{len(text.encode('utf-8'))} bytes is over the limit of {limit} bytes "
                                            "(--max-prompt-bytes; by default 16 bytes per token of the context)")
            ids = await pipeline.tokenizer.encode(text, deadline) if text else []
            info = await pipeline.pool.info(deadline)
            strs = (await pipeline.tokenizer.texts_in_context(ids, [[] for _ in ids], deadline))[0] \
                if body.return_token_strs and ids else None
        except GatewayError as error:
            raise from_gateway(error) from None
        return {"count": len(ids), "max_model_len": info.config.sequence_len, "tokens": ids,
                "token_strs": strs if body.return_token_strs else None}

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Json:
        self.check_model(body.model)
        try:
            text = await self.ctx.pipeline.tokenizer.decode(body.tokens, self._deadline())
        except GatewayError as error:
            api = from_gateway(error)
            if api.status == 400:
                api.param = "tokens"
                api.message = api.message.replace("token_ids", "tokens", 1)
            raise api from None
        return {"prompt": text}
