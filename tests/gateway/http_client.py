"""Small HTTP helpers for the HTTP API tests: the official openai client, urllib, curl."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from typing import Any

import openai


def sdk(base_url: str, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
    """The official client, without its automatic retries (a test must see the first answer)."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)


def post(url: str, body: dict | bytes, headers: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, dict]:
    """POST JSON; (status, decoded body) whatever the status."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def curl(*args: str, timeout: float = 60, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """The real curl binary (-s: no progress meter; -N: print SSE events as they arrive)."""
    return subprocess.run(["curl", "-sS", "-N", *args], capture_output=True, text=True, timeout=timeout,
                          input=input_text)


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of a Server-Sent Events body, in order."""
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
