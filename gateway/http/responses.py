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


def token_name(token: gateway_pb2.Token | gateway_pb2.TopToken | gateway_pb2.PromptToken, as_id: bool) -> str:
    """How logprobs name a token: its text, or vLLM's "token_id:<id>" (return_tokens_as_token_ids), which tells
    apart tokens that read alike or are no whole character."""
    return f"token_id:{token.id}" if as_id else token.text


def by_text(tops: Sequence[gateway_pb2.TopToken], as_id: bool = False) -> dict[str, float]:
    """OpenAI's {text: logprob} of a step's alternatives; of two that read alike, the more probable (the
    first: they come most probable first)."""
    out: dict[str, float] = {}
    for top in tops:
        out.setdefault(token_name(top, as_id), logprob(top.logprob))
    return out


def stop_reason(last: gateway_pb2.GenerateResponse) -> str | int | None:
    """vLLM's stop_reason of a completion's last message: the stop sequence or stop token id that ended it, else
    None (EOS, length)."""
    if last.stop_sequence:
        return last.stop_sequence
    return last.stop_token_id if last.HasField("stop_token_id") else None


def usage(lasts: Sequence[gateway_pb2.GenerateResponse], per_prompt: int = 1) -> Json:
    """OpenAI's usage of a request from its completions' last messages: each prompt once (completions
    i * per_prompt .. share prompt i), every completion's tokens."""
    prompt = sum({m.index // per_prompt: m.usage.prompt_tokens for m in lasts}.values())
    generated = sum(m.usage.completion_tokens for m in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


@dataclass
class Shaper:
    """Builds one request's response body or chunks."""

    endpoint: str  # "completions" or "chat"
    request_id: str
    model: str
    top_logprobs: int | None  # None: no logprobs in the response
    echo: bool = False  # completions: the prompt's tokens lead each choice's logprobs (its text leads the text)
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field goes with each choice (chat: the response)
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    n: int = 1  # completions per prompt (a completion request may hold several prompts)
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    created: int = field(default_factory=lambda: int(time.time()))
    # Characters of each completion's text already sent (completions' text_offset), by completion index.
    text_offsets: dict[int, int] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.endpoint == 'chat' else 'cmpl'}-{self.request_id}"

    def _envelope(self, obj: str) -> Json:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion_logprobs(self, tokens: Sequence[gateway_pb2.Token], index: int = 0,
                            prompt: Sequence[gateway_pb2.PromptToken] = ()) -> Json:
        """OpenAI's completions logprobs; `prompt` (echo) leads, its first token with null logprobs."""
        as_id = self.token_ids
        entries = [(p, logprob(p.logprob) if p.HasField("logprob") else None,
                    by_text(p.top_tokens, as_id) if p.HasField("logprob") else None) for p in prompt]
        entries += [(t, logprob(t.logprob), by_text(t.top_tokens, as_id)) for t in tokens]
        offsets = []  # where each token's text starts in the choice's text (with token ids too)
        for token, _, _ in entries:
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(token.text)
        return {"tokens": [token_name(e[0], as_id) for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries] if self.top_logprobs else None, "text_offset": offsets}

    @staticmethod
    def vllm_prompt_logprobs(prompt: Sequence[gateway_pb2.PromptToken]) -> list[Json | None]:
        """vLLM's prompt_logprobs: per prompt token, null for the first, else {id: {logprob, decoded_token}} for the
        token and its alternatives."""
        return [None if not p.HasField("logprob") else {
            **{str(top.id): {"logprob": logprob(top.logprob), "decoded_token": top.text} for top in p.top_tokens},
            str(p.id): {"logprob": logprob(p.logprob), "decoded_token": p.text}} for p in prompt]

    def chat_logprobs(self, tokens: Sequence[gateway_pb2.Token]) -> Json:
        def entry(token: gateway_pb2.Token | gateway_pb2.TopToken) -> Json:
            name = token_name(token, self.token_ids)
            return {"token": name, "logprob": logprob(token.logprob), "bytes": list(name.encode("utf-8"))}
        return {"content": [{**entry(t), "top_logprobs": [entry(top) for top in t.top_tokens]} for t in tokens]}

    def _logprobs(self, tokens: Sequence[gateway_pb2.Token], index: int = 0,
                  prompt: Sequence[gateway_pb2.PromptToken] = ()) -> Json | None:
        if self.top_logprobs is None:
            return None
        if self.endpoint == "chat":
            return self.chat_logprobs(tokens)
        return self.completion_logprobs(tokens, index, prompt if self.echo else ())

    def chunk(self, text: str, tokens: Sequence[gateway_pb2.Token], finish: str | None,
              include_usage: bool, index: int = 0, prompt: Sequence[gateway_pb2.PromptToken] = (),
              message: gateway_pb2.GenerateResponse | None = None) -> Json:
        """One streamed chunk of completion `index` carrying `text` (and its tokens' logprobs; the scored prompt
        on its first chunk), or its finish (with vLLM's stop_reason); `message`: the pipeline message it comes
        from (its usage so far when usage is continuous, its stop reason)."""
        logprobs = self._logprobs(tokens, index, prompt) if tokens or (prompt and self.echo) else None
        if self.endpoint == "chat":
            delta = {"content": text} if text or not finish else {}
            choice: Json = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            out = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            out = self._envelope("text_completion")
        if finish is not None:
            choice["stop_reason"] = stop_reason(message) if message is not None else None
        if prompt and self.prompt_logprobs:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(prompt)
        out["choices"] = [choice]
        if include_usage:  # OpenAI: null on every chunk but the final usage chunk; vLLM's continuous: the counts
            out["usage"] = usage([message]) if self.continuous_usage and message is not None else None
        return out

    def role_chunk(self, include_usage: bool, n: int = 1, prompt_tokens: int = 0) -> Json:
        """Chat streams open with the assistant role and empty content (for each of the n choices), as OpenAI's
        do."""
        out = self._envelope("chat.completion.chunk")
        out["choices"] = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None} for i in range(n)]
        if include_usage:
            out["usage"] = ({"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
                            if self.continuous_usage else None)
        return out

    def chunks(self, message: gateway_pb2.GenerateResponse, include_usage: bool) -> list[Json]:
        """The chunks of one pipeline message: its text, then (last message) the finish reason."""
        out = []
        # A token without text (EOS, or bytes of a character still incomplete) gets its own chunk
        # only when its logprob was asked for.
        if message.text or message.prompt_logprobs or (message.tokens and self.top_logprobs is not None):
            out.append(self.chunk(message.text, message.tokens, None, include_usage, message.index,
                                  message.prompt_logprobs, message))
        if message.finish_reason:
            out.append(self.chunk("", [], FINISH[message.finish_reason], include_usage, message.index,
                                  message=message))
        return out

    def usage_chunk(self, lasts: Sequence[gateway_pb2.GenerateResponse]) -> Json:
        """The extra final chunk `stream_options.include_usage` asks for: no choices, the usage."""
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage(lasts, self.n)}

    def whole(self, messages: Sequence[gateway_pb2.GenerateResponse]) -> Json:
        """The non-streaming response body for a finished stream: one choice per completion index."""
        indexes = sorted({m.index for m in messages})
        choices, lasts = [], []
        scored = [p for m in messages if m.index == 0 for p in m.prompt_logprobs]
        for index in indexes:
            mine = [m for m in messages if m.index == index]
            text = "".join(m.text for m in mine)
            tokens = [t for m in mine for t in m.tokens]
            finish = FINISH.get(mine[-1].finish_reason)
            lasts.append(mine[-1])
            if self.endpoint == "chat":
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": self._logprobs(tokens, index), "finish_reason": finish,
                                "stop_reason": stop_reason(mine[-1])})
            else:  # each completion's first message carries its own prompt's scores
                own = [p for m in mine for p in m.prompt_logprobs]
                choices.append({"index": index, "text": text, "logprobs": self._logprobs(tokens, index, own),
                                "finish_reason": finish, "stop_reason": stop_reason(mine[-1])})
                if self.prompt_logprobs:
                    choices[-1]["prompt_logprobs"] = self.vllm_prompt_logprobs(own)
        out = self._envelope("chat.completion" if self.endpoint == "chat" else "text_completion")
        if self.endpoint == "chat" and self.prompt_logprobs:
            out["prompt_logprobs"] = self.vllm_prompt_logprobs(scored)
        return {**out, "choices": choices, "usage": usage(lasts, self.n)}
