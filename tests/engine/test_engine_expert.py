"""The engine on meshes with an expert axis (DATA,EXPERT,MODEL = 1,4,2 / 1,8,1 / 2,4,1 of the 8 host devices
tests/conftest.py forces) reproduces the reference's seeded requests exactly: alone, with prompts split over
steps, and submitted together (a request's ids do not depend on what shares its steps); golden_wide at the
real vocabulary on (1,4,2)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from model_service.config import MeshConfig
from model_service.engine import Engine
from model_service.loading import ServerConfig, build_engine, resolve
from model_service.requests import GenerationRequest
from model_service.sampling_settings import SamplingSettings
from tests.engine.conftest import Runner, golden_requests, golden_server_config
from tests.engine.drive import serve_all
from tests.engine.test_engine_golden import golden_request, run_alone
from tests.procs import SHARED

MESHES = ["1,4,2", "1,8,1", "2,4,1"]
WIDE = SHARED / "golden_wide"


@pytest.fixture(scope="module", params=MESHES)
def expert_engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    config = golden_server_config(mesh=MeshConfig.parse(request.param), slots=4)
    engine = build_engine(config, resolve(config))
    assert engine.model.moe == "expert" and len(engine.mesh.devices.flat) == 8
    yield engine


def test_golden_requests_alone_and_split_over_steps_reproduce_reference_ids(expert_engine: Engine) -> None:
    for i, case in enumerate(golden_requests()):
        chunk = 5 if i % 2 else None
        assert run_alone(expert_engine, case, slot=i % expert_engine.slots, chunk=chunk) == case["output_ids"]


def test_golden_requests_submitted_together_reproduce_reference_ids(expert_engine: Engine, running: Runner) -> None:
    cases = golden_requests()
    results = serve_all(running(expert_engine), [golden_request(c, i) for i, c in enumerate(cases)])
    assert results == [c["output_ids"] for c in cases]


def test_golden_wide_requests_together_reproduce_reference_ids_on_an_expert_mesh(running: Runner) -> None:
    cases: list[dict[str, Any]] = json.loads((WIDE / "pipeline_fp32.json").read_text())["requests"]
    config = ServerConfig(config=str(WIDE / "config.json"), checkpoint=str(WIDE / "checkpoint"), host="127.0.0.1",
                          port=0, mesh=MeshConfig.parse("1,4,2"), slots=4)
    engine = build_engine(config, resolve(config))
    assert engine.model.moe == "expert"
    requests = [GenerationRequest(request_id=f"wide{i}", prompt=tuple(c["prompt_ids"]),
                                  max_tokens=c["request"]["max_len"], ignore_eos=True, seed=c["request"]["rng_seed"],
                                  sampling=SamplingSettings(temperature=c["request"]["temperature"],
                                                            top_p=c["request"]["nucleus_p"]))
                for i, c in enumerate(cases)]
    assert serve_all(running(engine), requests) == [c["output_ids"] for c in cases]
