"""`python scripts/ask_demo.py`: start the stack as `make run` does, ask the demo model a few questions, print.

Starts scripts/run_stack.py on free ports (the committed demo/ by default, no compile cache: a cold start),
prints how long it took until it served, then sends through the gateway's OpenAI-compatible HTTP API, greedy:
five short questions about its corpus (the Debian FAQ and this project's docs) and two structured requests
at 64 tokens, one with a json_schema and one with json_object, each answer followed by whether it parses.
It ends the stack with Ctrl-C's signal and exits non-zero when it could not start or a request failed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving_common.processes import free_port  # noqa: E402

READY = "Ctrl-C stops all three"
QUESTIONS = ("What is Debian GNU/Linux?", "Who created the Debian project?", "How do I report a bug in Debian?",
             "What does the gateway do?", "What does the tokenizer service do?")
JSON_QUESTION = "What is Debian GNU/Linux? Reply in JSON."
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
STRUCTURED = ({"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}, {"type": "json_object"})


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
        return str(json.loads(reply.read())["data"][0]["id"])


def ask(url: str, question: str, max_tokens: int, response_format: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": served_model(url), "messages": [{"role": "user", "content": question}],
                            "max_tokens": max_tokens, "temperature": 0.0}
    if response_format:
        body["response_format"] = response_format
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        choice = json.loads(reply.read())["choices"][0]
    return {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"]}


def parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def start(args: Sequence[str], http_port: int) -> tuple[subprocess.Popen[str], list[str], float]:
    """The stack, its output lines (filled by a thread) and the seconds until it served its sample."""
    ports = [*(f"--{name}-port={free_port()}" for name in ("gateway", "tokenizer", "model", "metrics",
                                                            "model-metrics")), f"--http-port={http_port}"]
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "scripts/run_stack.py", "--compile-cache", "", *ports, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    while not any(READY in line for line in lines):
        if proc.poll() is not None:
            raise RuntimeError("the stack exited before serving:\n" + "".join(lines[-40:]))
        time.sleep(0.2)
    return proc, lines, time.monotonic() - began


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/ask_demo.py", description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64, help="per answer")
    parser.add_argument("stack_args", nargs="*", help="passed to run_stack.py after --, e.g. -- --config X")
    args = parser.parse_args(argv)
    http_port = free_port()
    proc, _, seconds = start(args.stack_args, http_port)
    url = f"http://127.0.0.1:{http_port}"
    print(f"stack served after {seconds:.1f} s (cold: no compile cache)")
    try:
        for question in QUESTIONS:
            reply = ask(url, question, args.max_tokens)
            print(f"\nQ: {question}\nA: {reply['text'].strip()}  [{reply['finish_reason']}]")
        for fmt in STRUCTURED:
            reply = ask(url, JSON_QUESTION, 64, fmt)
            print(f"\nQ ({fmt['type']}, 64 tokens): {JSON_QUESTION}\nA: {reply['text'].strip()}  "
                  f"[{reply['finish_reason']}; parses: {parses(reply['text'])}]")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
