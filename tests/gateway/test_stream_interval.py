"""`--stream-interval N` (vLLM's flag): a completion's tokens reach its client N at a time, its first token and
its last message at once, and the texts, tokens, stops and usage are what a gateway without it sends."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import pytest

from gateway.client import GatewayClient
from tests.gateway.conftest import Stack, start_gateway
from tests.gateway.http_client import curl, sse_events
from tests.procs import Service, free_port

INTERVAL = 3


@pytest.fixture(scope="module")
def interval_gateway(fast_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A second gateway with --stream-interval 3 in front of the fast stack's fake tokenizer and model."""
    http_port = free_port()
    gateway = start_gateway(fast_stack.tokenizer.address, [m.address for m in fast_stack.models],
                            tmp_path_factory.mktemp("interval"), "--stream-interval", str(INTERVAL),
                            http_port=http_port)
    gateway.http_port = http_port  # type: ignore[attr-defined]
    try:
        gateway.wait_serving(60)
        yield gateway
    finally:
        gateway.terminate()


def messages(address: str, prompt: str, **options: object) -> list:
    with GatewayClient(address, timeout=30) as client:
        return list(client.generate(prompt, **options))


def test_tokens_arrive_n_at_a_time_after_the_first(fast_stack: Stack, interval_gateway: Service) -> None:
    every = messages(fast_stack.address, "hello world", max_tokens=8, ignore_eos=True)
    grouped = messages(interval_gateway.address, "hello world", max_tokens=8, ignore_eos=True)
    # [1] * 8 and [1, 3, 3, 1] (the first at once, the last with the finish); when the reader falls behind the
    # gateway joins messages that queued up (stream_buffer.bounded), so fewer, longer ones are right too.
    # Either way a message ends only where one of [1, 3, 3, 1] ends: after tokens 1, 4, 7 and 8.
    ends = [sum(len(m.tokens) for m in grouped[:i + 1]) for i in range(len(grouped))]
    assert sum(len(m.tokens) for m in every) == 8 and ends[-1] == 8 and set(ends) <= {1, 4, 7, 8}
    assert grouped[-1].finish_reason and not any(m.finish_reason for m in grouped[:-1])
    assert "".join(m.text for m in grouped) == "".join(m.text for m in every)
    assert [(t.id, t.text) for m in grouped for t in m.tokens] == [(t.id, t.text) for m in every for t in m.tokens]
    assert grouped[-1].finish_reason == every[-1].finish_reason
    assert grouped[-1].usage == every[-1].usage


def test_held_tokens_end_with_a_stop_sequence_as_without_the_interval(fast_stack: Stack,
                                                                     interval_gateway: Service) -> None:
    every = messages(fast_stack.address, "abcdefgh", max_tokens=20, ignore_eos=True, stop=["fg"])
    grouped = messages(interval_gateway.address, "abcdefgh", max_tokens=20, ignore_eos=True, stop=["fg"])
    assert "".join(m.text for m in grouped) == "".join(m.text for m in every)
    assert grouped[-1].stop_sequence == every[-1].stop_sequence == "fg"
    assert grouped[-1].usage == every[-1].usage
    tokens = sum(len(m.tokens) for m in grouped)
    assert 1 < tokens and len(grouped) <= 2 + (tokens - 1) // INTERVAL  # the first, then INTERVAL at a time


def test_http_stream_sends_fewer_events_with_the_same_text(fast_stack: Stack, interval_gateway: Service) -> None:
    def streamed(port: int) -> list[str]:
        body = json.dumps({"model": "grok-1", "prompt": "hello world", "max_tokens": 8, "ignore_eos": True,
                           "stream": True})
        done = curl(f"http://127.0.0.1:{port}/v1/completions", "-H", "content-type: application/json", "-d", body)
        chunks = [json.loads(e) for e in sse_events(done.stdout) if e != "[DONE]"]
        return [c["choices"][0]["text"] for c in chunks if c["choices"]]

    def ends(texts: list[str]) -> set[int]:
        return {len("".join(texts[:i + 1])) for i, text in enumerate(texts) if text}

    every, grouped = streamed(fast_stack.http_port), streamed(interval_gateway.http_port)  # type: ignore[attr-defined]
    assert "".join(grouped) == "".join(every) == "hello worldhello world"
    # The 8 tokens' texts end at 5, 6, 9, 11, 16, 17, 20, 22; an event ends only after tokens 1, 4, 7 and 8 (or
    # fewer of them: messages that queued up for a reader behind are joined).
    assert ends(every) <= {5, 6, 9, 11, 16, 17, 20, 22} and ends(grouped) <= {5, 11, 20, 22}


def test_the_interval_must_be_positive(fast_stack: Stack, tmp_path: pathlib.Path) -> None:
    gateway = start_gateway(fast_stack.tokenizer.address, [m.address for m in fast_stack.models], tmp_path,
                            "--stream-interval", "0")
    assert gateway.proc.wait(60) == 2
    gateway.terminate()
    assert "--stream-interval: 0 is not a positive integer" in gateway.logs()
