"""The engine reproduces the reference's seeded requests exactly (float32 golden checkpoint): alone, however its
prompt is split over steps, batched through the scheduler, and on a (2, 4) mesh."""

from __future__ import annotations

from typing import Any

import pytest

from model_service.config import MeshConfig
from model_service.engine import Engine
from model_service.loading import build_engine, resolve
from model_service.requests import GenerationRequest
from tests.engine.conftest import Runner, golden_requests, golden_sampling, golden_server_config
from tests.engine.drive import generate, serve_all
from tests.model.conftest import skip_without_devices


def run_alone(engine: Engine, case: dict[str, Any], slot: int, chunk: int | None = None) -> list[int]:
    q = case["request"]  # the reference's max_len counts generated tokens
    return generate(engine, case["prompt_ids"], golden_sampling(q), q["rng_seed"], q["max_len"], slot, chunk).tokens


def golden_request(case: dict[str, Any], i: int) -> GenerationRequest:
    q = case["request"]
    return GenerationRequest(f"g{i}", tuple(case["prompt_ids"]), golden_sampling(q), seed=q["rng_seed"],
                             max_tokens=q["max_len"])


@pytest.mark.parametrize("index", range(len(golden_requests())))
def test_seeded_golden_request_reproduces_reference_ids(golden_engine: Engine, index: int) -> None:
    case = golden_requests()[index]
    assert run_alone(golden_engine, case, slot=index % golden_engine.slots) == case["output_ids"]


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_golden_requests_with_their_prompts_split_over_steps_reproduce_reference_ids(golden_engine: Engine,
                                                                                    chunk: int) -> None:
    for case in golden_requests():
        assert run_alone(golden_engine, case, slot=1, chunk=chunk) == case["output_ids"]


def test_golden_requests_submitted_together_reproduce_reference_ids(golden_engine: Engine, running: Runner) -> None:
    cases = golden_requests()
    results = serve_all(running(golden_engine), [golden_request(c, i) for i, c in enumerate(cases)])
    assert results == [c["output_ids"] for c in cases]


def test_a_prompt_of_context_minus_one_tokens_gets_its_token(golden_engine: Engine, running: Runner) -> None:
    n = golden_engine.sequence_len - 1
    prompt = tuple(5 + (7 * i) % 400 for i in range(n))
    [tokens] = serve_all(running(golden_engine), [GenerationRequest("long", prompt, max_tokens=1)])
    assert len(tokens) == 1 and tokens[0] >= 0


@pytest.fixture(scope="module")
def sharded_engine() -> Engine:
    """The golden engine on a (data=2, model=4) mesh of the 8 host devices tests/conftest.py forces."""
    skip_without_devices(MeshConfig(2, 4))
    config = golden_server_config(mesh=MeshConfig(2, 4), slots=4)
    return build_engine(config, resolve(config))


def test_golden_requests_on_a_2x4_mesh_reproduce_reference_ids(sharded_engine: Engine) -> None:
    assert len(sharded_engine.mesh.devices.flat) == 8
    for i, case in enumerate(golden_requests()):
        assert run_alone(sharded_engine, case, slot=i % sharded_engine.slots) == case["output_ids"]


@pytest.fixture(scope="module")
def generic_engine() -> Engine:
    """The golden engine on the generic backend (what an accelerator runs: XLA's dot products, batched attention,
    one tile per step, the vectorised sampler), here on CPU."""
    config = golden_server_config(backend="generic", slots=4)
    return build_engine(config, resolve(config))


def test_the_generic_backend_reproduces_reference_ids(generic_engine: Engine, running: Runner) -> None:
    assert generic_engine.model.backend.name == "generic" and generic_engine.tile == generic_engine.max_rows
    cases = golden_requests()
    for i, case in enumerate(cases):
        assert run_alone(generic_engine, case, slot=i % generic_engine.slots, chunk=5) == case["output_ids"]
    results = serve_all(running(generic_engine), [golden_request(c, i) for i, c in enumerate(cases)])
    assert results == [c["output_ids"] for c in cases]
