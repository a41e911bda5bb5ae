"""Seeded requests at the real Grok-1 vocabulary (131,072 tokens) reproduce the reference exactly,
alone and batched: the nucleus filter's large-vocabulary branch (`SORT_MAX_VOCAB` and above) decides
which tokens can be drawn here (../shared/golden_wide/README.md)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from model_service import sampling
from model_service.config import MeshConfig
from model_service.engine import Engine
from model_service.requests import Emission, GenerationRequest
from model_service.sampling_settings import SamplingSettings
from model_service.loading import ServerConfig, build_engine, resolve
from tests.engine.conftest import Runner
from tests.procs import SHARED

WIDE = SHARED / "golden_wide"
CASES: list[dict[str, Any]] = json.loads((WIDE / "pipeline_fp32.json").read_text())["requests"]
SLOTS = 4


@pytest.fixture(scope="module")
def wide_engine() -> Iterator[Engine]:
    config = ServerConfig(config=str(WIDE / "config.json"), checkpoint=str(WIDE / "checkpoint"), host="127.0.0.1",
                          port=0, mesh=MeshConfig(1, 1), slots=SLOTS, buckets=(64,))
    cfg, buckets = resolve(config)
    yield build_engine(config, cfg, buckets)


def settings(case: dict[str, Any]) -> dict[str, Any]:
    q = case["request"]
    return dict(sampling=SamplingSettings(temperature=q["temperature"], top_p=q["nucleus_p"]), seed=q["rng_seed"])


def test_the_vocabulary_takes_the_large_vocabulary_nucleus_branch(wide_engine: Engine) -> None:
    assert wide_engine.vocab_size == 131072 > sampling.SORT_MAX_VOCAB
    assert any(case["request"]["nucleus_p"] < 1 for case in CASES)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_seeded_wide_request_alone_reproduces_the_reference(wide_engine: Engine, index: int) -> None:
    case = CASES[index]
    slot = index % SLOTS
    prefix, out = wide_engine.prefill(case["prompt_ids"], **settings(case))
    tokens = [int(out.token[0])]
    state = wide_engine.insert(prefix, wide_engine.init_decode_state(), slot)
    while len(tokens) < case["request"]["max_len"]:
        state, pending = wide_engine.generate(state)
        out = pending.get()
        tokens.append(int(out.token[slot]))
    assert tokens == case["output_ids"]


def test_seeded_wide_requests_batched_reproduce_the_reference(wide_engine: Engine) -> None:
    state = wide_engine.init_decode_state()
    outputs: list[list[int]] = []
    for slot, case in enumerate(CASES):  # every slot busy, each with its own settings
        prefix, out = wide_engine.prefill(case["prompt_ids"], **settings(case))
        outputs.append([int(out.token[0])])
        state = wide_engine.insert(prefix, state, slot)
    for _ in range(max(case["request"]["max_len"] for case in CASES) - 1):
        state, pending = wide_engine.generate(state)
        out = pending.get()
        for slot, tokens in enumerate(outputs):
            tokens.append(int(out.token[slot]))
    assert [tokens[:case["request"]["max_len"]] for tokens, case in zip(outputs, CASES)] == \
        [case["output_ids"] for case in CASES]


def test_seeded_wide_requests_submitted_together_through_the_scheduler(wide_engine: Engine,
                                                                       running: Runner) -> None:
    scheduler = running(wide_engine)
    results: list[list[int]] = [[] for _ in CASES]
    done = [threading.Event() for _ in CASES]

    def collector(i: int) -> Any:
        def emit(emission: Emission) -> None:
            results[i].extend(t.id for t in emission.tokens)
            if emission.finish_reason is not None or emission.error is not None:
                done[i].set()
        return emit

    for i, case in enumerate(CASES):
        q = case["request"]
        scheduler.submit(GenerationRequest(request_id=f"wide{i}", prompt=tuple(case["prompt_ids"]),
                                           max_tokens=q["max_len"], ignore_eos=True, **settings(case)),
                         collector(i))
    assert all(event.wait(120) for event in done)
    assert results == [case["output_ids"] for case in CASES]
