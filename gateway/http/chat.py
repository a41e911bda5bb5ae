"""Chat messages -> one prompt text, through a Jinja2 chat template (the way Hugging Face and vLLM do it).

Grok-1 is a base model with no chat format of its own: `templates/chat_default.jinja` writes the
conversation as a transcript ending in "Assistant:", and `--chat-template FILE` replaces it. Templates
run in Jinja2's immutable sandbox with the variables Hugging Face templates expect (`messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`).
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.http.errors import bad_request
from gateway.http.schemas import ChatMessage

DEFAULT_TEMPLATE = pathlib.Path(__file__).resolve().parent.parent / "templates" / "chat_default.jinja"


class TemplateRefused(Exception):
    """A template called raise_exception(): the conversation is not one it can render."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRefused(message)


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


class ChatTemplate:
    """A compiled chat template; `render` turns a conversation into the prompt text."""

    def __init__(self, source: str, name: str = "chat template") -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        try:
            self.template = environment.from_string(source)
        except TemplateError as error:
            raise ValueError(f"--chat-template: {name} is not a valid Jinja2 template: {error}") from None
        self.name = name

    @classmethod
    def load(cls, path: str | None = None) -> "ChatTemplate":
        """The template in `path`, or the default one; ValueError naming the flag when unusable."""
        file = pathlib.Path(path) if path else DEFAULT_TEMPLATE
        try:
            source = file.read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"--chat-template: cannot read {str(file)!r} ({error.strerror or error})") from None
        return cls(source, str(file))

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               extra: Mapping[str, Any] | None = None) -> str:
        """The prompt for `messages`; 400 naming `messages` when the template refuses them."""
        plain = [{"role": m.role, "content": message_text(m, i), **({"name": m.name} if m.name else {})}
                 for i, m in enumerate(messages)]
        variables = {**(extra or {}), "messages": plain, "add_generation_prompt": add_generation_prompt,
                     "bos_token": "", "eos_token": ""}
        try:
            prompt = self.template.render(**variables)
        except TemplateRefused as refused:
            raise bad_request("messages", str(refused)) from None
        except (TemplateError, TypeError, ValueError) as error:
            raise bad_request("messages", f"the chat template failed on these messages: {error}") from None
        if not prompt:
            raise bad_request("messages", "the chat template rendered an empty prompt")
        return prompt
