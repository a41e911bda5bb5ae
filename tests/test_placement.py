"""model_service.placement: its prediction equals the bytes JAX holds after loading (CPU meshes), Grok-1 fits a
v5e-32 with a pool for 8 full contexts, a layout that does not fit is refused with its numbers (the CLI and the
model service at startup, before loading anything)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.placement_check import WEIGHT_PARTS, check, shard_bytes
from model_service import backend, model, sampling_settings
from model_service.config import GROK_1, ConfigError, MeshConfig, load_model_config
from model_service.loading import ServerConfig, load_engine
from model_service.placement import (GB, Devices, Layout, Workload, candidate_layouts, check_service, choose,
                                     max_layers, place)
from model_service.placement.__main__ import main
from tests.procs import GOLDEN, ROOT, SHARED

MEDIUM = SHARED / "bench" / "medium.json"


@pytest.mark.parametrize(("config", "mesh", "dtype", "slots"), [
    (GOLDEN / "config.json", MeshConfig(1, 1), "float32", 2),
    (GOLDEN / "config.json", MeshConfig(1, 8), "bfloat16", 3),
    (GOLDEN / "config.json", MeshConfig(2, 4), "float32", 4),
    (GOLDEN / "config.json", MeshConfig(data=1, expert=4, model=2), "float32", 2),
    (GOLDEN / "config.json", MeshConfig(data=2, expert=4, model=1), "bfloat16", 2),
    (MEDIUM, MeshConfig(1, 8), "bfloat16", 2),
])
def test_prediction_is_the_bytes_each_device_holds_after_loading(config, mesh, dtype, slots) -> None:
    report = check(load_model_config(str(config)), mesh, dtype, slots)
    predicted, reported = report["predicted"], report["reported_shards"]
    for part in ("weights", "kv pool", "slot state"):
        assert set(reported[part]) == set(range(mesh.size)), part
        assert set(reported[part].values()) == {predicted[part]}, (part, predicted[part], reported[part])


@pytest.mark.parametrize(("config", "mesh"), [(GOLDEN / "config.json", MeshConfig(2, 4)),
                                             (MEDIUM, MeshConfig(1, 8))])
def test_with_native_cpu_products_the_startup_prediction_bounds_the_packed_weights(config, mesh) -> None:
    """float32 on CPU packs the weights for the native kernel and keeps the table in the checkpoint's bfloat16
    (in 13 bits where it can): the startup check counts it as bfloat16, an upper bound within 10 %."""
    server = ServerConfig(config=str(config), checkpoint=None, random_init=True, dtype="float32", mesh=mesh, slots=2)
    predicted = check_service(server)
    engine = load_engine(server, load_model_config(str(config)))
    assert engine.model.products.native, "the native kernels did not load"
    bound = sum(predicted.part(name) for name in WEIGHT_PARTS)
    held = shard_bytes(engine.params)
    assert len(held) == mesh.size and all(0.9 * bound <= b <= bound for b in held.values()), (bound, held)


def run_cli(*args: str) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, out.getvalue()


def test_grok1_fits_a_v5e_32_with_a_pool_for_8_sequences_of_8192_tokens() -> None:
    code, out = run_cli("--preset", "grok-1", "--devices", "v5e-32", "--dtype", "bfloat16", "--slots", "8",
                        "--context", "8192", "--json")
    result = json.loads(out)
    assert code == 0 and result["fits"]
    assert result["used"] <= 16 * GB and result["device_memory"] == 16 * GB
    assert result["per_device"]["kv pool"] >= 8 * 8192 * result["kv_per_token"]
    assert result["max_sequences"] >= 8
    assert result["mesh"] == "1,4,8" and result["runs_today"]  # an expert axis, which the service runs


def test_a_layout_that_does_not_fit_exits_1_with_the_numbers() -> None:
    code, out = run_cli("--preset", "grok-1", "--devices", "v5e-32", "--mesh", "4,8")  # data 4, model 8
    assert code == 1
    assert "does not fit" in out and "exceeds the 16.00 GB of one v5e device" in out
    assert "experts 38.65" in out  # today's layout: every chip holds all 8 experts' eighth


def test_no_layout_of_a_v5e_16_holds_grok1_and_the_closest_is_shown() -> None:
    code, out = run_cli("--preset", "grok-1", "--devices", "v5e-16")
    assert code == 1 and "mesh data,expert,model = 1,2,8" in out


def test_default_layout_is_the_smallest_replica_that_fits() -> None:
    devices, work = Devices.parse("v5e-32"), Workload("bfloat16", 8)
    chosen = choose(GROK_1, devices, work)
    smaller = [lay for lay in candidate_layouts(GROK_1, 32) if lay.expert * lay.model < 32]
    assert chosen.fits and chosen.layout == Layout(1, 4, 8)
    assert smaller and not any(place(GROK_1, devices, lay, work).fits for lay in smaller)


def test_expert_axis_splits_the_experts_and_not_attention_table_or_kv() -> None:
    work = Workload("bfloat16", 1)
    one = place(GROK_1, Devices.parse("v5e-8"), Layout(1, 1, 1), work)
    eight = place(GROK_1, Devices.parse("v5e-8"), Layout(1, 8, 1), work)
    assert eight.part("experts") * 8 == one.part("experts")
    for part in ("attention", "table", "kv pool", "router and norms"):
        assert eight.part(part) == one.part(part), part


def test_mesh_of_two_numbers_is_data_model_and_three_data_expert_model() -> None:
    assert Layout.parse("1,8") == Layout(1, 1, 8) and Layout.parse("2,4,8") == Layout(2, 4, 8)
    with pytest.raises(ConfigError, match="DATA,EXPERT,MODEL"):
        Layout.parse("1,2,3,4")


def test_a_model_axis_that_does_not_divide_the_heads_is_refused_with_the_reason() -> None:
    code, out = run_cli("--preset", "grok-1", "--devices", "h100-8", "--mesh", "1,3")
    assert code == 1 and "the model axis (3) must divide num_kv_heads (8)" in out
    assert run_cli("--preset", "grok-1", "--devices", "a100-8")[0] == 2


def test_one_v5e_holds_two_layers_of_grok1_width() -> None:
    work = Workload("bfloat16", 1)
    assert max_layers(GROK_1, Devices.parse("v5e-1"), Layout(1, 1, 1), work) == 2


def test_constants_are_the_engines() -> None:
    assert (model.KEY_CHUNK, model.BLOCK_SIZE) == (128, 16)
    from model_service import placement
    from model_service.placement import temporaries

    assert (temporaries.GENERIC_STEP_TOKENS, temporaries.CPU_STEP_TOKENS) == (backend.GENERIC_STEP_TOKENS,
                                                                             backend.CPU_STEP_TOKENS)
    assert (temporaries.KEY_CHUNK, placement.BLOCK_SIZE) == (model.KEY_CHUNK, model.BLOCK_SIZE)
    assert placement.MAX_ENDS == sampling_settings.MAX_ENDS


def test_check_service_passes_a_layout_that_fits_and_refuses_one_that_does_not() -> None:
    config = ServerConfig(config=str(GOLDEN / "config.json"), checkpoint=None, random_init=True, mesh=MeshConfig(1, 8))
    assert check_service(config).fits
    with pytest.raises(ConfigError, match="does not fit its devices: .* kv pool"):
        check_service(dataclasses.replace(config, kv_tokens=10**12))


def test_model_service_refuses_a_layout_that_does_not_fit_before_loading() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "model_service", "--config", str(GOLDEN / "config.json"),
                           "--random-init", "--port", "0", "--kv-tokens", str(10**12)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "does not fit its devices" in done.stderr and "kv pool" in done.stderr
    assert "loading weights" not in done.stderr and "weights ready" not in done.stderr
    assert time.monotonic() - start < 60


def test_device_kinds_have_the_documented_memory_and_cpu_splits_the_host() -> None:
    memory = {kind: Devices.parse(f"{kind}-2").memory for kind in ("v5e", "v6e", "v5p", "h100")}
    assert memory == {"v5e": 16 * GB, "v6e": 32 * GB, "v5p": 95 * GB, "h100": 80 * GB}
    from model_service.placement import host_memory

    assert Devices.parse("cpu-4").memory == host_memory() // 4
    assert Devices.parse("cpu-4", memory=10**9).memory == 10**9


def test_chip_check_script_runs_on_cpu_and_loads_the_layers_the_tool_says_fit(capsys: pytest.CaptureFixture) -> None:
    from benchmarks.placement_check import main as check_main

    assert check_main(["--config", str(GOLDEN / "config.json"), "--layers", "auto", "--slots", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers"] == 2  # all of golden's: the host holds them easily
    assert report["reported_shards"]["weights"] == {"0": report["predicted"]["weights"]}


def test_estimated_temporaries_bound_xlas_compiled_ones_on_a_mesh() -> None:
    """On a mesh (golden over data 2, model 4: a conditional per expert) the estimate is an upper bound of the
    step XLA compiles (one device's, and a factor 2 of it: tests/test_temporaries.py)."""
    report = check(load_model_config(str(GOLDEN / "config.json")), MeshConfig(2, 4), "float32", 8, temporaries=True)
    ratio = report["temporaries"]["compiled_over_predicted"]
    assert 0.5 <= ratio <= 1.0, report["temporaries"]  # 0.66 measured
