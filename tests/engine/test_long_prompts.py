"""Prompts up to the context with default flags: at context 2,048 (the golden weights; the context is a setting,
not a weight) a 1,100-token prompt is served (it was refused before: prompts were capped at the largest
prefill bucket, 1,024), one of exactly context - 1 tokens gets its token, and one of context tokens is refused
naming the limit."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import pytest

from model_service.engine import Engine
from model_service.loading import build_engine, resolve
from model_service.requests import ErrorKind, GenerationRequest, SchedulerError
from tests.engine.conftest import Runner, golden_server_config
from tests.engine.drive import serve_all
from tests.procs import GOLDEN

CONTEXT = 2048


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    cfg = json.loads((GOLDEN / "config.json").read_text())
    cfg["sequence_len"] = CONTEXT
    path = pathlib.Path(tmp_path_factory.mktemp("long")) / "config.json"
    path.write_text(json.dumps(cfg))
    config = golden_server_config(config=str(path), slots=2)
    yield build_engine(config, resolve(config))


def test_prompts_longer_than_1024_tokens_and_up_to_the_context_are_served(long_engine: Engine,
                                                                         running: Runner) -> None:
    scheduler = running(long_engine)
    prompts = [tuple(3 + (i * 7) % 500 for i in range(n)) for n in (1100, CONTEXT - 1)]
    results = serve_all(scheduler, [GenerationRequest(f"l{n}", p, max_tokens=3 if len(p) < CONTEXT - 1 else 1)
                                    for n, p in enumerate(prompts)], timeout=600)
    assert [len(r) for r in results] == [3, 1] and all(t >= 0 for r in results for t in r)
    with pytest.raises(SchedulerError) as caught:
        scheduler.submit(GenerationRequest("full", (5,) * CONTEXT, max_tokens=1), lambda e: None)
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT
    assert f"the longest accepted is {CONTEXT - 1}" in str(caught.value)
