"""The examples of the docs pages that call the stack `make run` starts, run as written against it (only the
ports change): every command of their bash blocks exits 0 with output, every Python block runs. Pages whose
examples need another stack (TLS, compose, Kubernetes) are run elsewhere: the API-key commands of security.md
by tests/gateway/test_run_stack.py, compose by `make compose-check`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.demo.launcher import Launched
from tests.demo.test_readme import code_blocks, on_stack, shell_commands
from tests.procs import ROOT

pytestmark = pytest.mark.slow

PAGES = ["api.md", "structured_output.md", "tracing.md", "deploy.md"]  # deploy.md: its calls to the published ports
# Commands that are not calls to a running stack: templates with "..." to fill in, other stacks' commands.
NOT_FOR_THIS_STACK = re.compile(r"\.\.\. |docker |kubectl ")


def run_shell(command: str, stack: Launched) -> str:
    """Run `command` aimed at the stack; the client's default address (GROK_CLIENT_ADDRESS) is the stack's too."""
    done = subprocess.run(["bash", "-c", on_stack(command, stack)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "GROK_CLIENT_ADDRESS": stack.address})
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout


def commands(page: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    return [c for block in code_blocks(text, "bash") for c in shell_commands(block) if not NOT_FOR_THIS_STACK.search(c)]


@pytest.mark.parametrize("page", PAGES)
def test_every_shell_example_of_the_page_runs_as_written(demo_stack: Launched, page: str) -> None:
    found = commands(page)
    assert found, f"no runnable example found in {page}"
    for command in found:
        output = run_shell(command, demo_stack)
        assert output.strip(), command
        if command.startswith("curl -s ") and "-N" not in command.split()[1] and "/metrics" not in command:
            assert "error" not in json.loads(output), (command, output)


@pytest.mark.parametrize("page", ["api.md", "structured_output.md"])
def test_every_python_example_of_the_page_runs_as_written(demo_stack: Launched, page: str) -> None:
    programs = code_blocks((ROOT / "docs" / page).read_text(encoding="utf-8"), "python")
    assert programs
    for program in programs:
        done = subprocess.run([sys.executable, "-c", on_stack(program, demo_stack)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (program, done.stderr)
        assert done.stdout.strip()


def test_the_api_pages_chat_call_over_grpc_answers_without_the_separator_space(demo_stack: Launched) -> None:
    (chat,) = [c for c in commands("api.md") if c.endswith("GatewayService/Chat")]
    replies = [json.loads(part) for part in re.split(r"(?<=\})\n(?=\{)", run_shell(chat, demo_stack).strip())]
    text = "".join(r.get("text", "") for r in replies)
    assert text.startswith("The gateway"), text
    assert replies[-1]["finish_reason"] == "FINISH_REASON_EOS"
