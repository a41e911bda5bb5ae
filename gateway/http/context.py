"""What the HTTP routes need from the gateway (one value, built by gateway.server)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.auth import ApiKeys
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
