"""docs/CONTRACTS.md's command lines agree with the services' parsers: every flag it names exists, and every
default it shows (`[--flag DEFAULT]`) is the one `--help` shows."""

from __future__ import annotations

import re

import pytest

from scripts.stack_flags import service_actions
from tests.procs import ROOT

ROWS = {"tokenizer": "python -m tokenizer_service", "model": "python -m model_service", "gateway": "python -m gateway"}


def command_line(service: str) -> str:
    text = (ROOT / "docs" / "CONTRACTS.md").read_text(encoding="utf-8")
    (line,) = [line for line in text.splitlines() if line.startswith(f"| {service} | `{ROWS[service]} ")]
    return line.split("`")[1]


@pytest.mark.parametrize("service", list(ROWS))
def test_contracts_command_lines_name_real_flags_with_their_real_defaults(service: str) -> None:
    actions = service_actions(service)
    line = command_line(service)
    for flag in re.findall(r"(--[a-z0-9-]+)", line):
        assert flag in actions, f"{service}: docs/CONTRACTS.md names {flag}, which the service does not have"
    for flag, shown in re.findall(r"\[(--[a-z0-9-]+) ([^\]\s|]+)\]", line):
        if shown.isupper() or not re.fullmatch(r"[\w.]+", shown):
            continue  # a placeholder (PATH, URL[,URL...]), not a default
        default = actions[flag].default
        same = shown == str(default) or (isinstance(default, (int, float)) and float(shown) == default)
        assert same, f"{service}: docs/CONTRACTS.md shows {flag} {shown}, --help {default}"
