"""OpenAI chat messages -> the prompt text, through the gateway's chat template (gateway.chat_template).

OpenAI's content may be a string or a list of parts; only text parts are served (joined by newlines).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gateway.chat_template import DEFAULT_TEMPLATE, TemplateRefused
from gateway.chat_template import ChatTemplate as BaseTemplate
from gateway.errors import GatewayError
from gateway.http.errors import bad_request, from_gateway
from gateway.http.schemas import ChatMessage

__all__ = ["DEFAULT_TEMPLATE", "ChatTemplate", "TemplateRefused", "chat_prompt", "message_text"]


def message_text(message: ChatMessage, index: int) -> str:
    """The message's content as text: a string, or its text parts joined by newlines."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{index}].content", f"a '{part.type}' part is not supported; send text parts")
        texts.append(part.text)
    return "\n".join(texts)


class ChatTemplate(BaseTemplate):
    """The chat template, rendering OpenAI's message objects."""

    @classmethod
    def of(cls, template: BaseTemplate) -> "ChatTemplate":
        """`template`, already compiled, for OpenAI's message objects."""
        made = cls.__new__(cls)
        made.__dict__.update(vars(template))
        return made

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               extra: Mapping[str, Any] | None = None, continue_final: bool = False) -> str:
        """The prompt for `messages`; 400 naming `messages` when the template refuses them."""
        turns = [{"role": m.role, "content": message_text(m, i), **({"name": m.name} if m.name else {})}
                 for i, m in enumerate(messages)]
        try:
            return self.render_turns(turns, add_generation_prompt, extra, continue_final)
        except GatewayError as error:
            raise from_gateway(error, "chat") from None


class ChatFields(Protocol):
    """What a chat completion and a /tokenize of messages share."""

    messages: Any
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None
    model_fields_set: set[str]


def chat_prompt(template: ChatTemplate, body: ChatFields) -> str:
    """The prompt of a chat request's messages, with vLLM's rendering fields."""
    if body.chat_template is not None:
        raise bad_request("chat_template", "this server renders every chat with its own template (--chat-template); "
                                           "a template sent with the request is not used: leave it out")
    if body.continue_final_message and body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise bad_request("add_generation_prompt", "cannot be true with continue_final_message: true (the last "
                                                   "message is continued, no new turn opened); leave it out")
    return template.render(body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                           body.continue_final_message)
