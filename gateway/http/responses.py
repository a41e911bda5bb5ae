"""Gateway stream messages -> OpenAI response bodies and streaming chunks (plain dicts, JSON-ready).

`Shaper` knows one request's id, model name, endpoint and whether logprobs were asked for; it turns
each GenerateResponse of the pipeline into the chunks OpenAI streams (`text_completion` or
`chat.completion.chunk`), and a whole stream into one response body.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grok.gateway.v1 import gateway_pb2

FINISH = {
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_CONTEXT_LENGTH: "length",
    gateway_pb2.FINISH_REASON_EOS: "stop",
    gateway_pb2.FINISH_REASON_STOP: "stop",
}
# JSON has no -Infinity; a token of probability 0 (masked out) reports this instead, as vLLM does.
MIN_LOGPROB = -9999.0

Json = dict[str, Any]


def logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def usage(message: gateway_pb2.GenerateResponse) -> Json:
    u = message.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


@dataclass
class Shaper:
    """Builds one request's response body or chunks."""

    endpoint: str  # "completions" or "chat"
    request_id: str
    model: str
    top_logprobs: int | None  # None: no logprobs in the response
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0  # characters of completion text already sent (completions' text_offset)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.endpoint == 'chat' else 'cmpl'}-{self.request_id}"

    def _envelope(self, obj: str) -> Json:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion_logprobs(self, tokens: Sequence[gateway_pb2.Token]) -> Json:
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token.text)
        tops = ([{top.text: logprob(top.logprob) for top in t.top_tokens} for t in tokens]
                if self.top_logprobs else None)
        return {"tokens": [t.text for t in tokens], "token_logprobs": [logprob(t.logprob) for t in tokens],
                "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def chat_logprobs(tokens: Sequence[gateway_pb2.Token]) -> Json:
        return {"content": [
            {"token": t.text, "logprob": logprob(t.logprob), "bytes": list(t.text.encode("utf-8")),
             "top_logprobs": [{"token": top.text, "logprob": logprob(top.logprob),
                               "bytes": list(top.text.encode("utf-8"))} for top in t.top_tokens]}
            for t in tokens]}

    def _logprobs(self, tokens: Sequence[gateway_pb2.Token]) -> Json | None:
        if self.top_logprobs is None:
            return None
        return self.chat_logprobs(tokens) if self.endpoint == "chat" else self.completion_logprobs(tokens)

    def chunk(self, text: str, tokens: Sequence[gateway_pb2.Token], finish: str | None,
              include_usage: bool) -> Json:
        """One streamed chunk carrying `text` (and its tokens' logprobs), or the finish reason."""
        if self.endpoint == "chat":
            delta = {"content": text} if text or not finish else {}
            choice: Json = {"index": 0, "delta": delta, "logprobs": self._logprobs(tokens) if tokens else None,
                            "finish_reason": finish}
            out = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(tokens) if tokens else None,
                      "finish_reason": finish}
            out = self._envelope("text_completion")
        out["choices"] = [choice]
        if include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the final usage chunk
        return out

    def role_chunk(self, include_usage: bool) -> Json:
        """Chat streams open with the assistant role and empty content, as OpenAI's do."""
        out = self._envelope("chat.completion.chunk")
        out["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}]
        if include_usage:
            out["usage"] = None
        return out

    def chunks(self, message: gateway_pb2.GenerateResponse, include_usage: bool) -> list[Json]:
        """The chunks of one pipeline message: its text, then (last message) the finish reason."""
        out = []
        # A token without text (EOS, or bytes of a character still incomplete) gets its own chunk
        # only when its logprob was asked for.
        if message.text or (message.tokens and self.top_logprobs is not None):
            out.append(self.chunk(message.text, message.tokens, None, include_usage))
        if message.finish_reason:
            out.append(self.chunk("", [], FINISH[message.finish_reason], include_usage))
        return out

    def usage_chunk(self, last: gateway_pb2.GenerateResponse) -> Json:
        """The extra final chunk `stream_options.include_usage` asks for: no choices, the usage."""
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage(last)}

    def whole(self, messages: Sequence[gateway_pb2.GenerateResponse]) -> Json:
        """The non-streaming response body for a finished stream."""
        text = "".join(m.text for m in messages)
        tokens = [t for m in messages for t in m.tokens]
        last = messages[-1]
        finish = FINISH.get(last.finish_reason)
        if self.endpoint == "chat":
            choice: Json = {"index": 0, "message": {"role": "assistant", "content": text},
                            "logprobs": self._logprobs(tokens), "finish_reason": finish}
            out = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(tokens), "finish_reason": finish}
            out = self._envelope("text_completion")
        return {**out, "choices": [choice], "usage": usage(last)}
