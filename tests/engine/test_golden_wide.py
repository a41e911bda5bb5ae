"""Seeded requests at the real Grok-1 vocabulary (131,072 tokens) reproduce the reference exactly,
alone and batched: the nucleus filter's large-vocabulary branch (`SORT_MAX_VOCAB` and above) decides
which tokens can be drawn here (../shared/golden_wide/README.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from model_service import sampling
from model_service.config import MeshConfig
from model_service.engine import Engine
from model_service.requests import GenerationRequest
from model_service.sampling_settings import SamplingSettings
from model_service.loading import ServerConfig, build_engine, resolve
from tests.engine.conftest import Runner
from tests.engine.drive import generate, serve_all
from tests.procs import SHARED

WIDE = SHARED / "golden_wide"
CASES: list[dict[str, Any]] = json.loads((WIDE / "pipeline_fp32.json").read_text())["requests"]
SLOTS = 4


@pytest.fixture(scope="module")
def wide_engine() -> Iterator[Engine]:
    config = ServerConfig(config=str(WIDE / "config.json"), checkpoint=str(WIDE / "checkpoint"), host="127.0.0.1",
                          port=0, mesh=MeshConfig(1, 1), slots=SLOTS)
    yield build_engine(config, resolve(config))


def settings(case: dict[str, Any]) -> dict[str, Any]:
    q = case["request"]
    return dict(sampling=SamplingSettings(temperature=q["temperature"], top_p=q["nucleus_p"]), seed=q["rng_seed"])


def request(case: dict[str, Any], i: int) -> GenerationRequest:
    return GenerationRequest(request_id=f"wide{i}", prompt=tuple(case["prompt_ids"]),
                             max_tokens=case["request"]["max_len"], ignore_eos=True, **settings(case))


def test_the_vocabulary_takes_the_large_vocabulary_nucleus_branch(wide_engine: Engine) -> None:
    assert wide_engine.vocab_size == 131072 > sampling.SORT_MAX_VOCAB
    assert any(case["request"]["nucleus_p"] < 1 for case in CASES)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_seeded_wide_request_alone_reproduces_the_reference(wide_engine: Engine, index: int) -> None:
    case = CASES[index]
    s = settings(case)
    drawn = generate(wide_engine, case["prompt_ids"], s["sampling"], s["seed"], case["request"]["max_len"],
                     slot=index % SLOTS, chunk=3 if index % 2 else None)  # half of them split over steps
    assert drawn.tokens == case["output_ids"]


def test_seeded_wide_requests_submitted_together_through_the_scheduler(wide_engine: Engine,
                                                                       running: Runner) -> None:
    results = serve_all(running(wide_engine), [request(c, i) for i, c in enumerate(CASES)])
    assert results == [case["output_ids"] for case in CASES]


def test_the_generic_backend_reproduces_the_wide_reference(running: Runner) -> None:
    """XLA's dot products, batched attention, one tile per step, the vectorised sampler (what an accelerator
    runs), at the real vocabulary."""
    config = ServerConfig(config=str(WIDE / "config.json"), checkpoint=str(WIDE / "checkpoint"), host="127.0.0.1",
                          port=0, mesh=MeshConfig(1, 1), slots=SLOTS, backend="generic")
    engine = build_engine(config, resolve(config))
    assert engine.model.backend.name == "generic"
    results = serve_all(running(engine), [request(c, i) for i, c in enumerate(CASES)])
    assert results == [case["output_ids"] for case in CASES]
