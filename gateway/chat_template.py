"""Chat turns -> one prompt text, through a Jinja2 chat template (the way Hugging Face and vLLM do it).

Grok-1 is a base model with no chat format of its own: `templates/chat_default.jinja` writes the
conversation as a transcript ending in "Assistant:", and `--chat-template FILE` replaces it. Templates
run in Jinja2's immutable sandbox with the variables Hugging Face templates expect (`messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`). The gRPC Chat call and HTTP's
/v1/chat/completions render through the same template (gateway.http.chat adds OpenAI's message parts).
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import invalid

DEFAULT_TEMPLATE = pathlib.Path(__file__).resolve().parent / "templates" / "chat_default.jinja"
# Where the default template's transcript starts another turn than the assistant's: a base model that goes on
# writing the transcript has ended its answer there (its corpus's dialogues put EOS only after the last turn).
DEFAULT_TURN_STARTS = ("\n\nUser:", "\n\nSystem:")


class TemplateRefused(Exception):
    """A template called raise_exception(): the conversation is not one it can render."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRefused(message)


class ChatTemplate:
    """A compiled chat template; `render_turns` turns a conversation into the prompt text. `turn_starts`: the
    texts that begin another turn in what it writes, which end a chat answer as stop sequences do (the default
    template's; none for a template of one's own, whose format the gateway does not know)."""

    def __init__(self, source: str, name: str = "chat template", turn_starts: Sequence[str] = ()) -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        try:
            self.template = environment.from_string(source)
        except TemplateError as error:
            raise ValueError(f"--chat-template: {name} is not a valid Jinja2 template: {error}") from None
        self.name = name
        self.turn_starts = tuple(turn_starts)

    @classmethod
    def load(cls, path: str | None = None) -> "ChatTemplate":
        """The template in `path`, or the default one; ValueError naming the flag when unusable."""
        file = pathlib.Path(path) if path else DEFAULT_TEMPLATE
        try:
            source = file.read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"--chat-template: cannot read {str(file)!r} ({error.strerror or error})") from None
        return cls(source, str(file), DEFAULT_TURN_STARTS if file.resolve() == DEFAULT_TEMPLATE else ())

    def render_turns(self, turns: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                     extra: Mapping[str, Any] | None = None, continue_final: bool = False) -> str:
        """The prompt for `turns` ({"role", "content"[, "name"]} each); INVALID_ARGUMENT naming `messages` when
        the template refuses them (GatewayError: HTTP answers it 400). `continue_final` (vLLM's and Hugging Face's
        continue_final_message): the prompt ends with the last message's text, left open for the model to go on
        with it (what the template writes after that text, e.g. the end of its turn, is cut)."""
        if not turns:
            raise invalid("messages", "must hold at least one message")
        prompt = self._render(turns, add_generation_prompt and not continue_final, extra)
        if not continue_final:
            return prompt
        final = turns[-1]["content"].strip()
        if not final:
            raise invalid("continue_final_message", "the last message has no text to continue; leave it out or "
                                                     "send add_generation_prompt instead")
        at = prompt.rfind(final)
        if at < 0:
            raise invalid("continue_final_message", "the chat template does not write the last message's text as "
                                                    "sent, so it cannot be continued")
        return prompt[:at + len(final)]

    def _render(self, turns: Sequence[Mapping[str, str]], add_generation_prompt: bool,
                extra: Mapping[str, Any] | None) -> str:
        variables = {**(extra or {}), "messages": [dict(t) for t in turns],
                     "add_generation_prompt": add_generation_prompt, "bos_token": "", "eos_token": ""}
        try:
            prompt = self.template.render(**variables)
        except TemplateRefused as refused:
            raise invalid("messages", str(refused)) from None
        except (TemplateError, TypeError, ValueError, RecursionError) as error:
            raise invalid("messages", f"the chat template failed on these messages: {error}") from None
        if not prompt:
            raise invalid("messages", "the chat template rendered an empty prompt")
        return prompt
