"""A request's output constraint (structured output) as a plain value: what the servicer builds from the proto.

structured.py compiles it into a grammar over the vocabulary; here it is only data, so requests.py and the
servicer need no grammar engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class Constraint:
    """What the output must match. `text` is the schema (JSON text), regex or grammar; `choices` for CHOICE."""

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The request field as the APIs spell it (in error messages)."""
        return f"constraint.{self.kind.value}"
