"""Structured logging: one JSON object per line on stderr, tagged with the current request id."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
import uuid
from typing import Any

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}
# Libraries whose INFO records are about their own internals: jax logs at INFO, on every machine without a
# TPU, that it could not load libtpu while picking a backend. Their warnings (a GPU found but no CUDA-enabled
# jaxlib, say) still show; --log-level debug shows everything.
QUIET_LIBRARIES = ("jax", "jaxlib")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "request_id": getattr(record, "request_id", None) or request_id_var.get(),
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and key != "request_id" and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(service: str, level: str = "info") -> None:
    """Send every log record to stderr as JSON. Called once from a service's __main__."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(root.level if root.level <= logging.DEBUG else max(root.level, logging.WARNING))


def new_request_id(metadata: Any = None, given: str = "") -> str:
    """The request id: the caller's (field or `x-request-id` metadata) or a fresh one."""
    if given:
        return given
    for key, value in metadata or ():
        if key == "x-request-id" and value:
            return str(value)
    return uuid.uuid4().hex[:16]
