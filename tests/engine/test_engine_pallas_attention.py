"""The generic backend with its decode rows attending through the Pallas kernel (in interpret mode on CPU: the
kernel's arithmetic and block copies, what a TPU runs) reproduces the reference's seeded requests (float32 golden
checkpoint), alone, with its prompt split over steps, and served together (prompt chunks beside decodes)."""

from __future__ import annotations

import jax
import pytest

from model_service import backend
from model_service.engine import Engine
from model_service.loading import build_engine, resolve
from model_service.ops.pallas import PallasAttention
from tests.engine.conftest import Runner, golden_requests, golden_server_config
from tests.engine.drive import serve_all
from tests.engine.test_engine_golden import golden_request, run_alone


@pytest.fixture(scope="module")
def kernel_engine() -> Engine:
    config = golden_server_config(backend="generic", slots=4, step_tokens=16, attention="pallas")
    if jax.default_backend() == "tpu":  # the compiled kernel
        engine = build_engine(config, resolve(config))
    else:
        with pytest.MonkeyPatch.context() as patch:  # what --attention pallas takes on a TPU, on CPU's interpreter
            patch.setattr(backend, "choose_attention", lambda choice, mesh, *_: "pallas_interpret")
            engine = build_engine(config, resolve(config))
    engine.compile()
    return engine


def test_decodes_through_the_pallas_kernel_reproduce_reference_ids(kernel_engine: Engine, running: Runner,
                                                                   compilations: list[str]) -> None:
    assert isinstance(kernel_engine.model.ops.attention, PallasAttention) and kernel_engine.model.scan_layers
    cases = golden_requests()
    results = serve_all(running(kernel_engine), [golden_request(c, i) for i, c in enumerate(cases)])
    assert results == [c["output_ids"] for c in cases]
    assert compilations == [], f"{len(compilations)} programs compiled while serving"
    for i, case in enumerate(cases):
        assert run_alone(kernel_engine, case, slot=i % kernel_engine.slots, chunk=5) == case["output_ids"]
