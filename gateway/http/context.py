"""What the HTTP routes need from the gateway (one value, built by gateway.server)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from gateway.auth import ApiKeys
from gateway.errors import GatewayError
from gateway.http.chat import ChatTemplate
from gateway.pipeline import Pipeline
from serving_common.grpc_server import HealthReporter


@dataclass(frozen=True)
class HttpContext:
    """What the routes need from the gateway."""

    pipeline: Pipeline
    health: HealthReporter
    keys: ApiKeys
    template: ChatTemplate
    model_name: str
    timeout_seconds: float  # 0: no server-side deadline
    created: int  # the model card's `created`: when this gateway started (Unix seconds)

    async def model_card(self) -> dict[str, Any]:
        """The served model as vLLM's /v1/models lists it: with `max_model_len`, the context the model service
        reports (cached by the gateway after its first answer), once one has answered; a model list must answer
        while the model service still starts, so then the card goes without it."""
        card: dict[str, Any] = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "grok-serve",
                                "root": self.model_name, "parent": None}
        try:
            loop = asyncio.get_running_loop()
            info = await self.pipeline.pool.info(loop.time() + MODEL_CARD_WAIT_SECONDS)
        except GatewayError:
            return card
        return {**card, "max_model_len": info.config.sequence_len}


MODEL_CARD_WAIT_SECONDS = 2.0  # how long /v1/models waits for a model service that has not answered yet
