"""Request bodies of the OpenAI-compatible API as pydantic models: OpenAI's field names, types and
defaults, plus the extra sampling fields vLLM accepts. Unknown top-level fields are ignored, as
OpenAI-compatible servers do, so clients that send newer fields keep working; they are kept aside
(`model_extra`) so that the response and the log can name them (mapping.ignored_fields).

Whether a field's value can be served is decided in `mapping.py`, not here: these models only parse.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.http.errors import bad_request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries the usage so far (prompt, that choice's tokens).
    continuous_usage_stats: bool = False


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in parsed JSON holding a lone UTF-16 surrogate.

    JSON may escape one ("\\ud800"); Python then holds a str that is not Unicode text, and it failed
    with a 500 wherever it was first encoded (protobuf, the tokenizer). ASCII strings are skipped
    with one C-speed check, so ordinary bodies cost a walk over their few fields.
    """
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        name = key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else str(key)
        where = f"{path}.{name}" if path else name  # printable even when the key is the bad string
        found = lone_surrogate_at(key, where) if isinstance(key, str) else None
        found = found or lone_surrogate_at(item, where)
        if found:
            return found
    return None


class SamplingFields(BaseModel):
    """Fields both endpoints share (OpenAI's, then vLLM's extras) with their documented defaults."""

    model_config = ConfigDict(extra="allow")  # kept in model_extra and only named, never used

    @model_validator(mode="before")
    @classmethod
    def _unicode_text_only(cls, data: Any) -> Any:
        """Refuse a lone surrogate anywhere in the body with a 400 naming its field (raised past pydantic,
        which would report it at the body's root)."""
        if (field := lone_surrogate_at(data)) is not None:
            raise bad_request(field, "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not Unicode "
                                     "text: pair it with its other half or send the character itself")
        return data

    model: str | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # prefix-cache isolation (vLLM's); checked by gateway/validation.py
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the context)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" instead of their text
    # vLLM's fields this server refuses unless they mean "off" (mapping.unsupported_features): parsed so that a
    # request using them is answered 400 instead of having them ignored.
    use_beam_search: bool = False
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    prompt_embeds: Any = None
    guided_whitespace_pattern: str | None = None
    priority: int = 0
    # Structured output (gateway/http/structured.py): OpenAI's, vLLM's, and vLLM's older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None  # OpenAI's older form of tools: refused as tools are
    function_call: Any = None
    modalities: list[str] | None = None  # only ["text"]
    audio: dict[str, Any] | None = None  # refused: no audio output
    echo: bool = False  # vLLM's chat echo: refused
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused (gateway/http/chat.py): the server's template renders every chat
    chat_template_kwargs: dict[str, Any] | None = None


Endpoint = Literal["completions", "chat"]
