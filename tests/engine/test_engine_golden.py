"""The engine reproduces the reference's seeded requests exactly (float32 golden checkpoint)."""

from __future__ import annotations

from typing import Any

import pytest

from model_service.config import MeshConfig
from model_service.engine import Engine
from model_service.loading import build_engine, resolve
from model_service.model import GrokModel
from tests.engine.conftest import golden_requests, golden_sampling, golden_server_config


def run_alone(engine: Engine, case: dict[str, Any], slot: int) -> list[int]:
    q = case["request"]
    state = engine.init_decode_state()
    prefix, out = engine.prefill(case["prompt_ids"], golden_sampling(q), seed=q["rng_seed"])
    tokens = [int(out.token[0])]
    state = engine.insert(prefix, state, slot)
    while len(tokens) < q["max_len"]:  # the reference's max_len counts generated tokens
        state, pending = engine.generate(state)
        tokens.append(int(pending.get().token[slot]))
    return tokens


@pytest.mark.parametrize("index", range(len(golden_requests())))
def test_seeded_golden_request_reproduces_reference_ids(golden_engine: Engine, index: int) -> None:
    case = golden_requests()[index]
    assert run_alone(golden_engine, case, slot=index % golden_engine.slots) == case["output_ids"]


def test_golden_requests_in_one_batch_reproduce_reference_ids(golden_engine: Engine) -> None:
    cases = golden_requests()
    state = golden_engine.init_decode_state()
    outputs: list[list[int]] = []
    for slot, case in enumerate(cases):
        q = case["request"]
        prefix, out = golden_engine.prefill(case["prompt_ids"], golden_sampling(q), seed=q["rng_seed"])
        outputs.append([int(out.token[0])])
        state = golden_engine.insert(prefix, state, slot + 3)
    for _ in range(19):
        state, pending = golden_engine.generate(state)
        out = pending.get()
        for slot, toks in enumerate(outputs):
            toks.append(int(out.token[slot + 3]))
    assert outputs == [c["output_ids"] for c in cases]


def test_prompt_beyond_largest_bucket_is_refused(golden_engine: Engine) -> None:
    with pytest.raises(ValueError, match="largest prefill bucket"):
        golden_engine.prefill([5] * (max(golden_engine.buckets) + 1), seed=0)


@pytest.fixture(scope="module")
def sharded_engine() -> Engine:
    """The golden engine on a (data=2, model=4) mesh of the 8 host devices tests/conftest.py forces."""
    config = golden_server_config(mesh=MeshConfig(2, 4), slots=4, buckets=(32,))
    cfg, buckets = resolve(config)
    return build_engine(config, cfg, buckets)


def test_golden_requests_prefilled_in_chunks_reproduce_reference_ids(golden_engine: Engine) -> None:
    m = golden_engine.model
    model = GrokModel(m.cfg, m.mesh, m.dtype, m.products, block_size=8)
    chunked = Engine(model, golden_engine.params, m.cfg, golden_engine.mesh, 2, golden_engine.buckets, prefill_chunk=8)
    cases = golden_requests()
    assert any(chunked.chunked(len(c["prompt_ids"])) for c in cases)
    for case in cases:
        q = case["request"]
        state = chunked.init_decode_state()
        out = None
        if chunked.chunked(len(case["prompt_ids"])):
            job = chunked.begin_prefill(case["prompt_ids"], golden_sampling(q), slot=1, seed=q["rng_seed"])
            while out is None:
                state, out = chunked.prefill_next_chunk(job, state)
        else:
            prefix, out = chunked.prefill(case["prompt_ids"], golden_sampling(q), seed=q["rng_seed"])
            state = chunked.insert(prefix, state, 1)
        tokens = [int(out.token[0])]
        while len(tokens) < q["max_len"]:
            state, pending = chunked.generate(state)
            tokens.append(int(pending.get().token[1]))
        assert tokens == case["output_ids"]


def test_golden_requests_on_a_2x4_mesh_reproduce_reference_ids(sharded_engine: Engine) -> None:
    assert len(sharded_engine.mesh.devices.flat) == 8
    for i, case in enumerate(golden_requests()):
        assert run_alone(sharded_engine, case, slot=i % sharded_engine.slots) == case["output_ids"]
