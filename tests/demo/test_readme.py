"""The README's examples, run as written against the demo stack: every command of "Calling it", the sample
`make run` shows, and the demo table's chat rows. Only the ports change (the stack runs on free ones), and
`.venv/bin/...` becomes this interpreter's folder where the tests run from another virtualenv."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from openai import OpenAI

from gateway.client import GatewayClient
from grok.gateway.v1 import gateway_pb2
from tests.demo.conftest import corpus_prose, sentences
from tests.demo.launcher import Launched
from scripts.run_stack import parse_args
from tests.procs import ROOT

pytestmark = pytest.mark.slow

README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def shell_commands(block: str) -> list[str]:
    """The commands of a bash block, continuation lines joined."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


def on_stack(text: str, stack: Launched) -> str:
    """`text` aimed at the launched stack: its ports in place of `make run`'s defaults."""
    for default, name in ((50051, "gateway"), (50052, "tokenizer"), (50053, "model"), (8000, "http"),
                          (9090, "metrics"), (9091, "model-metrics")):
        text = text.replace(f"127.0.0.1:{default}", f"127.0.0.1:{stack.ports[name]}")
    venv_bin = ROOT / ".venv" / "bin"
    if not (venv_bin / "grpcurl").exists() or pathlib.Path(sys.executable).parent != venv_bin:
        text = text.replace(".venv/bin/", f"{pathlib.Path(sys.executable).parent}/")
    return text


def run_shell(command: str) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout


def assert_corpus_sentences(text: str) -> None:
    prose = corpus_prose()
    assert sentences(text), text
    for sentence in sentences(text):
        assert sentence in prose, sentence


def test_every_command_of_calling_it_runs_as_written(demo_stack: Launched) -> None:
    blocks = code_blocks(section("Calling it"), "bash")
    commands = [c for block in blocks for c in shell_commands(block)]
    assert [c.split()[0] for c in commands] == [".venv/bin/grpcurl", "curl"]
    grpc_reply = json.loads(run_shell(on_stack(commands[0], demo_stack)))
    assert grpc_reply["finish_reason"] == "FINISH_REASON_EOS"  # grpcurl prints the proto field names
    (prompt,) = re.findall(r'"prompt": "([^"]+)"', commands[0])
    assert f"{prompt} {grpc_reply['text'].strip()}" in corpus_prose()
    http_reply = json.loads(run_shell(on_stack(commands[1], demo_stack)))
    assert_corpus_sentences(http_reply["choices"][0]["message"]["content"])


def test_the_python_example_runs_as_written(demo_stack: Launched) -> None:
    (program,) = code_blocks(section("Calling it"), "python")
    done = subprocess.run([sys.executable, "-c", on_stack(program, demo_stack)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "temperature" in done.stdout
    assert_corpus_sentences(done.stdout)


def test_the_streaming_client_line_runs_as_written(demo_stack: Launched) -> None:
    (command,) = re.findall(r"`(\.venv/bin/python -m gateway\.client [^`]+)`", section("Calling it"))
    assert run_shell(on_stack(command, demo_stack) + f" --address {demo_stack.address}").strip()


def test_the_sample_make_run_shows_is_what_the_model_writes(client: GatewayClient) -> None:
    (prompt, shown), = re.findall(r"sample completion of '([^']+)' \(streamed as it arrives\):\n(.+)\n",
                                  section("What `make run` shows"))
    (default,) = re.findall(r'"--prompt", default="([^"]+)"', (ROOT / "scripts" / "run_stack.py").read_text())
    assert prompt == default
    assert client.complete(prompt, max_tokens=48, temperature=0.0).text.strip() == shown.strip()


def table_rows(kind: str) -> list[tuple[str, str]]:
    """The demo table's rows of one kind ("completion" or "chat"): (the request cell, the text shown)."""
    return re.findall(rf"^\| {kind}:? (.+?) \| (.+?) \|$", section("The demo model"), re.M)


def assert_shown(text: str, ended: bool, shown: str) -> None:
    """`shown` is the whole text ending "*(EOS)*" when the model ended it, else its start followed by "..."."""
    if shown.endswith(" *(EOS)*"):
        assert ended and text.strip() == shown.removesuffix(" *(EOS)*"), text
    else:
        assert shown.endswith(" ...") and text.strip().startswith(shown.removesuffix(" ...")), text


def test_the_demo_tables_completion_rows_are_what_the_model_writes(client: GatewayClient) -> None:
    rows = table_rows("completion")
    assert len(rows) >= 3
    for request, shown in rows:
        (prompt,) = re.findall(r"^`([^`]+)`", request)
        reply = client.complete(prompt, max_tokens=48, temperature=0.0)
        assert_shown(reply.text, reply.finish_reason == gateway_pb2.FINISH_REASON_EOS, shown)


def test_the_demo_tables_chat_rows_are_what_the_model_answers(demo_stack: Launched) -> None:
    rows = table_rows("chat")
    assert len(rows) >= 4
    with OpenAI(base_url=f"{demo_stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as openai:
        for request, shown in rows:
            messages = [{"role": "system", "content": s} for s in re.findall(r"system `([^`]+)`", request)]
            messages += [{"role": "user", "content": u} for u in re.findall(r"user `([^`]+)`", request)]
            reply = openai.chat.completions.create(model="grok-1", messages=messages,  # type: ignore[arg-type]
                                                   temperature=0, max_tokens=96)
            choice = reply.choices[0]
            assert_shown(choice.message.content or "", choice.finish_reason == "stop", shown)


def test_the_make_run_options_shown_are_launcher_flags() -> None:
    shown = re.findall(r'^make run ARGS="([^"]+)"$', section("What `make run` shows"), re.M)
    assert len(shown) >= 2
    for args in shown:
        parse_args(shlex.split(args))  # argparse exits on an unknown flag or a bad value
