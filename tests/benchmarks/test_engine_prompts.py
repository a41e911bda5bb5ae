"""benchmarks.engine's prompts: the times to first token it reports are of whole prompts, as llama.cpp's are.

The model service serves a prompt's leading whole blocks from its prefix cache (on by default), so a measured
prompt that repeats an earlier request's first block would compute only its tail: its time to first token would
not be a 32-token prompt's, and the ratio to llama.cpp (which computes every prompt whole) would flatter us.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import pytest

from benchmarks import engine
from model_service.model import BLOCK_SIZE


def test_no_measured_prompt_shares_a_cached_block_with_an_earlier_request(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, ...]] = []

    def recorded(stub: Any, prompt: list[int], tokens: int, seed: int, mode: str) -> dict[str, float]:
        sent.append(tuple(prompt))
        return {"start": 0.0, "first": 0.1, "end": 1.0, "tokens": tokens}

    monkeypatch.setattr(engine, "stream", recorded)
    monkeypatch.setattr(engine.grpc, "insecure_channel", lambda address: contextlib.nullcontext())
    monkeypatch.setattr(engine.model_pb2_grpc, "ModelServiceStub", lambda channel: None)
    args = argparse.Namespace(prompt_len=32, tokens=8)
    # One service measured as the tool does: each run, every mode in turn (and the other points' stream counts).
    for run in range(2):
        for streams in (1, 8):
            for mode in ("greedy", "sampled", "json"):
                engine.measure("unused", streams, args, 131072, mode, run)
    assert all(len(p) == 32 for p in sent)
    first_blocks = [p[:BLOCK_SIZE] for p in sent]
    assert len(set(first_blocks)) == len(first_blocks), "a request repeats an earlier one's first KV block"


def test_as_user_reads_the_prompt_tokens_the_cache_served_from_the_services_metrics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import as_user

    page = (b"# HELP grok_model_prefix_cache_hits_total Prompt tokens served from the prefix cache\n"
            b"# TYPE grok_model_prefix_cache_hits_total counter\n"
            b"grok_model_prefix_cache_hits_total 48.0\n"
            b"grok_model_prefix_cache_hits_created 1.7e+09\n")
    monkeypatch.setattr(as_user.urllib.request, "urlopen", lambda url, timeout: contextlib.nullcontext(
        type("Page", (), {"read": lambda self: page})()))
    service = as_user.Service.__new__(as_user.Service)
    service.metrics = "http://127.0.0.1:1/metrics"
    assert service.cached_tokens() == 48
