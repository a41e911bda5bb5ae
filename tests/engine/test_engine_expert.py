"""The engine on meshes with an expert axis (DATA,EXPERT,MODEL = 1,4,2 / 1,8,1 / 2,4,1 of the 8 host devices
tests/conftest.py forces) reproduces the reference's seeded requests exactly: alone, with prompts split over
steps, and submitted together; golden_wide at the real vocabulary on (1,4,2); and test_invariance.py's bit-level
batch invariance on (1,4,2)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import pytest

from model_service.checkpoint import load_params
from model_service.config import MeshConfig, load_model_config
from model_service.engine import Engine
from model_service.loading import ServerConfig, build_engine, resolve
from model_service.model import GrokModel
from model_service.requests import GenerationRequest
from model_service.sampling_settings import SamplingSettings
from model_service.sharding import make_mesh
from tests.engine.conftest import Runner, golden_requests, golden_server_config
from tests.engine.drive import serve_all
from tests.engine.test_engine_golden import golden_request, run_alone
from tests.engine.test_invariance import requests as invariance_requests, run
from tests.procs import GOLDEN, SHARED

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


def test_on_an_expert_mesh_requests_split_and_mixed_at_random_equal_their_solo_runs_bit_for_bit() -> None:
    """test_invariance.py's batch invariance (tokens, probabilities and alternatives) on mesh 1,4,2: a row's
    bits do not depend on what shares its step's tiles, though every expert group computes its own experts."""
    cfg = load_model_config(str(GOLDEN / "config.json"))
    mesh = make_mesh(MeshConfig.parse("1,4,2"))
    model = GrokModel(cfg, mesh, jnp.float32, block_size=8, key_chunk=16)
    assert model.moe == "expert"
    params = load_params(str(GOLDEN / "checkpoint"), cfg, mesh, jnp.float32, pack=model.products.native,
                         stacked=model.backend.stacked_experts)
    engine = Engine(model, params, cfg, mesh, 4, step_tokens=16, tile=4)
    solo = invariance_requests(6)
    for r in solo:
        run(engine, [r], [0], None)
    mixed = invariance_requests(6)
    run(engine, mixed, joins=[0, 0, 1, 3, 3, 4], rng=random.Random(3))
    assert [r.out for r in mixed] == [r.out for r in solo]
