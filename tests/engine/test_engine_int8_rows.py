"""The generic backend with `--products int8` serves: every program compiled before serving, the golden requests
answered in full, the same tokens on a second run (the rounding is deterministic), and off the reference's float32
tokens only as far as the rounding takes them (tests/model/test_int8_rows.py bounds the logits)."""

from __future__ import annotations

import pytest

from model_service.engine import Engine
from model_service.loading import build_engine, resolve
from model_service.model.layers import Products
from tests.engine.conftest import Runner, golden_requests, golden_server_config
from tests.engine.drive import serve_all
from tests.engine.test_engine_golden import golden_request


@pytest.fixture(scope="module")
def int8_engine() -> Engine:
    config = golden_server_config(backend="generic", slots=4, step_tokens=16, products="int8")
    engine = build_engine(config, resolve(config))
    engine.compile()
    return engine


def test_int8_rows_serve_the_golden_requests_deterministically(int8_engine: Engine, running: Runner,
                                                               compilations: list[str]) -> None:
    assert int8_engine.model.products is Products.DOT_INT8
    cases = golden_requests()
    requests = [golden_request(c, i) for i, c in enumerate(cases)]
    first = serve_all(running(int8_engine), requests)
    again = serve_all(running(int8_engine), [golden_request(c, i) for i, c in enumerate(cases)])
    assert first == again and [len(r) for r in first] == [len(c["output_ids"]) for c in cases]
    assert compilations == [], f"{len(compilations)} programs compiled while serving"
    assert first != [c["output_ids"] for c in cases]  # rounded rows: not the float32 reference's every token
