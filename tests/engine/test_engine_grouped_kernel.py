"""The generic backend with the Pallas grouped-experts kernel (in interpret mode on CPU: what a TPU runs, the
kernel's arithmetic included) reproduces the reference's seeded requests exactly (float32 golden checkpoint)."""

from __future__ import annotations

import pytest

from model_service import backend
from model_service.engine import Engine
from model_service.loading import build_engine, resolve
from model_service.model.weights import GroupedWeight
from tests.engine.conftest import golden_requests, golden_server_config
from tests.engine.test_engine_golden import run_alone


@pytest.fixture(scope="module")
def kernel_engine() -> Engine:
    config = golden_server_config(backend="generic", slots=4, step_tokens=16)
    with pytest.MonkeyPatch.context() as patch:  # the choice a TPU device gets, on CPU's interpreter
        patch.setattr(backend, "choose_moe", lambda name, mesh, choice="auto", faithful=False: "pallas_interpret")
        return build_engine(config, resolve(config))


def test_the_pallas_experts_reproduce_reference_ids(kernel_engine: Engine) -> None:
    assert kernel_engine.model.moe == "pallas_interpret"
    out = kernel_engine.params["transformer/decoder_layers/moe/linear_1"]["w"]
    # Stacked (experts, and the layers for the scan), and the row blocks of 86 rows padded to 128 once, as the
    # kernel reads them (grouped.kernel_layout).
    layers = kernel_engine.model_config.model.num_layers
    assert isinstance(out, GroupedWeight) and out.rows == 688 and out.weight.shape == (layers, 8, 1024, 128)
    for i, case in enumerate(golden_requests()):
        assert run_alone(kernel_engine, case, slot=i % kernel_engine.slots, chunk=5) == case["output_ids"]
