"""Logging on stderr, tagged with the current request id and, when a traced call is running, its trace id:
one JSON object per line for log collectors, or one readable line for a person (`--log-format text|json`;
`auto`, the default, is text when stderr is a terminal)."""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import sys
import time
from typing import Any, TextIO

from opentelemetry import trace
from serving_common.randomness import random_hex

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}
# Libraries whose INFO records are about their own internals: jax logs at INFO, on every machine without a
# TPU, that it could not load libtpu while picking a backend. Their warnings (a GPU found but no CUDA-enabled
# jaxlib, say) still show; --log-level debug shows everything.
QUIET_LIBRARIES = ("jax", "jaxlib")


LOG_FORMATS = ("auto", "text", "json")


def add_flag(parser: argparse.ArgumentParser) -> None:
    """--log-format (and its GROK_<SERVICE>_LOG_FORMAT variable on an EnvArgumentParser)."""
    add = getattr(parser, "add_env_argument", parser.add_argument)
    add("--log-format", choices=LOG_FORMATS, default="auto",
        help="log lines as JSON objects (for log collectors) or as text for a person; auto: text when stderr is "
             "a terminal, else JSON")


def resolve_format(log_format: str, stream: TextIO) -> str:
    """'text' or 'json': auto becomes text on a terminal."""
    if log_format == "auto":
        try:
            return "text" if stream.isatty() else "json"
        except (AttributeError, ValueError):
            return "json"
    return log_format


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's extra fields (`logger.info(msg, extra={...})`)."""
    return {key: value for key, value in vars(record).items()
            if key not in _RESERVED and key != "request_id" and not key.startswith("_")}


class TextFormatter(logging.Formatter):
    """`06:48:23.120 INFO  gateway  request  method=Complete code=OK  [rid 3f2a...]`: one line a person reads."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        fields = " ".join(f"{key}={value}" for key, value in _fields(record).items())
        rid = getattr(record, "request_id", None) or request_id_var.get()
        line = f"{stamp} {record.levelname:<7} {self.service}  {record.getMessage()}"
        line += f"  {fields}" if fields else ""
        line += f"  [request {rid}]" if rid and rid != "-" else ""
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


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
        # The trace beside the request id: a slow request's log lines lead to its spans (serving_common.tracing).
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = format(span.trace_id, "032x")
        entry.update(_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(service: str, level: str = "info", log_format: str = "json") -> None:
    """Send every log record to stderr, as JSON or text (`auto`: text on a terminal). Called once from a
    service's __main__."""
    handler = logging.StreamHandler(sys.stderr)
    text = resolve_format(log_format, sys.stderr) == "text"
    handler.setFormatter(TextFormatter(service) if text else JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(root.level if root.level <= logging.DEBUG else max(root.level, logging.WARNING))


# One limit at every edge (vLLM's too): ids are for logs and traces, and gRPC's header budget (8 KiB by
# default) must not be spent on them; a longer one was refused by a backend at random.
MAX_REQUEST_ID_CHARS = 128


def request_id_too_long(value: str) -> str | None:
    """What is wrong with a caller's request id that must be refused (None: usable or replaceable)."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        return (f"at most {MAX_REQUEST_ID_CHARS} characters (got {len(value)}): send a shorter id, "
                "or none to get a generated one")
    return None


def _usable(value: str) -> bool:
    """Printable ASCII only: the characters a gRPC metadata value may hold (anything else failed at the
    first backend the id was forwarded to)."""
    return value.isascii() and value.isprintable()


def new_request_id(metadata: Any = None, given: str = "") -> str:
    """The request id: the caller's (field or `x-request-id` metadata) or a fresh one when there is none or
    it holds characters other than printable ASCII. Check the length first (`request_id_too_long`)."""
    if given:
        return given if _usable(given) else random_hex(16)
    for key, value in metadata or ():
        if key == "x-request-id" and value:
            value = str(value)
            return value if _usable(value) else random_hex(16)
    return random_hex(16)


def given_request_id(metadata: Any) -> str:
    """The caller's `x-request-id` metadata as sent ("" when none)."""
    for key, value in metadata or ():
        if key == "x-request-id":
            return str(value)
    return ""
