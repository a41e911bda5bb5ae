"""OpenAI chat messages -> the prompt text, through the gateway's chat template (gateway.chat_template).

OpenAI's content may be a string or a list of parts; only text parts are served (joined by newlines).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.chat_template import DEFAULT_TEMPLATE, TemplateRefused
from gateway.chat_template import ChatTemplate as BaseTemplate
from gateway.errors import GatewayError
from gateway.http.errors import bad_request, from_gateway
from gateway.http.schemas import ChatMessage

__all__ = ["DEFAULT_TEMPLATE", "ChatTemplate", "TemplateRefused", "message_text"]


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

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               extra: Mapping[str, Any] | None = None) -> str:
        """The prompt for `messages`; 400 naming `messages` when the template refuses them."""
        turns = [{"role": m.role, "content": message_text(m, i), **({"name": m.name} if m.name else {})}
                 for i, m in enumerate(messages)]
        try:
            return self.render_turns(turns, add_generation_prompt, extra)
        except GatewayError as error:
            raise from_gateway(error, "chat") from None
