"""A request's output constraint (structured output) as a plain value: what the servicer builds from the proto.

structured.py compiles it into a grammar over the vocabulary; here it is only data, plus the cheap checks of
its size that need no grammar engine (`size_problem`: text length, number of choices, grammar rules, nesting
depth), so requests.py and the servicer need no grammar engine. The limits are declared once, in
serving_common.limits. Every scan here is a loop over the text: a constraint nested a million deep costs one
pass and a clear message, never a recursion.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from serving_common.limits import MAX_CHOICES, MAX_CONSTRAINT_CHARS, MAX_CONSTRAINT_DEPTH, MAX_GRAMMAR_RULES


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


@dataclass(frozen=True)
class Bounds:
    """How big a constraint may be before the grammar engine sees it (tests lower or raise them)."""

    chars: int = MAX_CONSTRAINT_CHARS  # schema / regex / grammar text, or the choices together
    choices: int = MAX_CHOICES
    rules: int = MAX_GRAMMAR_RULES  # rule (and terminal) definitions of a Lark or GBNF grammar
    depth: int = MAX_CONSTRAINT_DEPTH  # JSON nesting of a schema, parentheses of a regex or a grammar


BOUNDS = Bounds()
# A Lark definition starts a line: `name:`, `?name:`, `!name:`, `NAME.2:`; a GBNF one is `name ::=` anywhere.
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?[0-9]+)?[ \t]*:(?!:)", re.MULTILINE)
_GBNF_RULE = re.compile(r"::=")


def size_problem(c: Constraint, bounds: Bounds = BOUNDS) -> str:
    """What makes `c` too big to compile ("field: ..." naming the limit and the fix), or ""."""
    size = len(c.text) + sum(len(x) for x in c.choices)
    if size > bounds.chars:
        return f"{c.field}: {size} characters is over the limit of {bounds.chars}; send a smaller constraint"
    if c.kind is ConstraintKind.CHOICE:
        if not c.choices or len(c.choices) > bounds.choices or any(not x for x in c.choices):
            return f"{c.field}: give 1..{bounds.choices} non-empty strings (got {len(c.choices)})"
        return ""
    if c.kind is ConstraintKind.GRAMMAR:
        rules = len(_GBNF_RULE.findall(c.text)) or len(_LARK_RULE.findall(c.text))
        if rules > bounds.rules:
            return (f"{c.field}: {rules} rules is over the limit of {bounds.rules}; write the grammar with fewer "
                    "rules (a repetition such as x* instead of a chain of rules)")
    if c.kind is ConstraintKind.JSON_SCHEMA:
        depth = json_depth(c.text)
    else:
        depth = paren_depth(c.text, quotes=c.kind is ConstraintKind.GRAMMAR)
    if depth > bounds.depth:
        what = "levels of JSON nesting" if c.kind is ConstraintKind.JSON_SCHEMA else "levels of nested parentheses"
        return f"{c.field}: {depth} {what} is over the limit of {bounds.depth}; flatten the constraint"
    return ""


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON text (strings skipped; malformed text is scanned
    the same way, json.loads reports what is wrong with it afterwards)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def paren_depth(text: str, quotes: bool = False) -> int:
    """The deepest nesting of parentheses in a regex or (`quotes`) a grammar: escaped ones (`\\(`) and those
    inside a grammar's quoted literals do not count. Over-counting a parenthesis inside a character class only makes
    the bound a little stricter."""
    depth = deepest = 0
    quote = ""
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote:
            if ch == quote:
                quote = ""
        elif ch == '"' and quotes:
            quote = ch
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest
