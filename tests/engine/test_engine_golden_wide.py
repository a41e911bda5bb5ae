"""At the real 131,072-token vocabulary (../shared/golden_wide) the engine reproduces the reference's seeded
requests exactly: the nucleus search, the reused exponentials and the draw, alone and batched in decode tiles."""

from __future__ import annotations

import json
from typing import Any

import pytest

import jax.numpy as jnp

from model_service.checkpoint import load_params
from model_service.config import MeshConfig, load_model_config
from model_service.engine import Engine
from model_service.model import GrokModel
from model_service.sharding import make_mesh
from tests.engine.test_engine_golden import run_alone
from tests.procs import SHARED

WIDE = SHARED / "golden_wide"


def wide_requests() -> list[dict[str, Any]]:
    return json.loads((WIDE / "pipeline_fp32.json").read_text())["requests"]


@pytest.fixture(scope="module")
def wide_engine() -> Engine:
    """4 slots decoded in tiles of 2, so a batch crosses a tile boundary and idle tiles are skipped."""
    cfg = load_model_config(str(WIDE / "config.json"))
    mesh = make_mesh(MeshConfig(1, 1))
    params = load_params(str(WIDE / "checkpoint"), cfg, mesh, jnp.float32)
    return Engine(GrokModel(cfg, mesh, jnp.float32), params, cfg, mesh, 4, (64,), row_tile=2)


@pytest.mark.parametrize("index", range(len(wide_requests())))
def test_seeded_wide_vocabulary_request_alone_reproduces_reference_ids(wide_engine: Engine, index: int) -> None:
    case = wide_requests()[index]
    assert run_alone(wide_engine, case, slot=3 - index % 4) == case["output_ids"]


def test_wide_vocabulary_requests_in_one_batch_reproduce_reference_ids(wide_engine: Engine) -> None:
    cases = wide_requests()
    state = wide_engine.init_decode_state()
    outputs: list[list[int]] = []
    for slot, case in enumerate(cases):
        q = case["request"]
        prefix, out = wide_engine.prefill(case["prompt_ids"], seed=q["rng_seed"], temperature=q["temperature"],
                                          top_p=q["nucleus_p"])
        outputs.append([int(out.token[0])])
        state = wide_engine.insert(prefix, state, slot)
    while any(len(o) < c["request"]["max_len"] for o, c in zip(outputs, cases)):
        state, pending = wide_engine.generate(state)
        out = pending.get()
        for slot, (toks, case) in enumerate(zip(outputs, cases)):
            if len(toks) < case["request"]["max_len"]:
                toks.append(int(out.token[slot]))
    assert outputs == [c["output_ids"] for c in cases]
