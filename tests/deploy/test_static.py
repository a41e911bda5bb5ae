"""Static checks of the deployment files: Compose v2 and hadolint accept them, and they say what
the deployment promises (health-gated start, only the gateway published, read-only weights, GPUs,
a non-root image whose health check speaks grpc.health.v1)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib

import pytest

from tests.deploy.compose import (
    COMPOSE_FILE, DOCKERFILE, GROK1_FILE, build_context_entries, dockerfile_instructions, resolved_config, run_compose, shell_commands,
    stage, tool)
from tests.procs import ROOT

SERVICES = {"tokenizer": 50052, "model": 50053, "gateway": 50051}


@pytest.fixture(scope="module")
def default() -> dict:
    return resolved_config(COMPOSE_FILE)


@pytest.fixture(scope="module")
def grok1() -> dict:
    return resolved_config(COMPOSE_FILE, GROK1_FILE)


@pytest.mark.parametrize("files", [(COMPOSE_FILE,), (COMPOSE_FILE, GROK1_FILE)], ids=["default", "grok1"])
def test_compose_config_quiet_passes(files: tuple[pathlib.Path, ...]) -> None:
    done = run_compose(files, "config", "-q")
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_compose_config_rejects_a_broken_file(tmp_path: pathlib.Path) -> None:
    # The validator really validates: the same file with a dangling depends_on must fail.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("      tokenizer:\n        condition", "      tokenize:\n        condition"))
    done = run_compose((broken,), "config", "-q")
    assert done.returncode != 0 and "tokenize" in done.stderr


def test_hadolint_reports_nothing_on_the_dockerfile() -> None:
    done = subprocess.run([tool("hadolint"), "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_gateway_starts_only_after_tokenizer_and_model_are_healthy(default: dict) -> None:
    deps = default["services"]["gateway"]["depends_on"]
    assert {name: d["condition"] for name, d in deps.items()} == {
        "tokenizer": "service_healthy", "model": "service_healthy"}


def test_every_service_health_checks_its_own_grpc_port(default: dict) -> None:
    for name, port in SERVICES.items():
        svc = default["services"][name]
        assert svc["environment"][f"GROK_{name.upper()}_PORT"] == str(port)
        assert svc["healthcheck"]["test"] == [
            "CMD", "python", "-m", "serving_common.healthcheck", f"127.0.0.1:{port}"]


def test_services_run_under_an_init_and_restart_unless_stopped(default: dict) -> None:
    for name in SERVICES:
        svc = default["services"][name]
        assert svc["init"] is True and svc["restart"] == "unless-stopped", name


def test_only_gateway_grpc_http_and_metrics_ports_are_published(default: dict) -> None:
    published = {name: svc.get("ports", []) for name, svc in default["services"].items()}
    assert published["tokenizer"] == []
    gateway = {(p["target"], p.get("published")) for p in published["gateway"]}
    assert gateway == {(50051, "50051"), (8000, "8000"), (9090, "9090")}
    assert default["services"]["gateway"]["environment"]["GROK_GATEWAY_HTTP_PORT"] == "8000"
    # A model replica publishes only its metrics port, on a host port Docker picks (so --scale works).
    assert [(p["target"], p.get("published")) for p in published["model"]] == [(9090, None)]
    assert default["services"]["model"]["environment"]["GROK_MODEL_METRICS_PORT"] == "9090"
    assert default["services"]["gateway"]["environment"]["GROK_GATEWAY_METRICS_PORT"] == "9090"
    assert {p["host_ip"] for ps in published.values() for p in ps} == {"127.0.0.1"}


def test_gateway_finds_model_replicas_through_the_service_name(default: dict) -> None:
    env = default["services"]["gateway"]["environment"]
    assert env["GROK_GATEWAY_MODEL"] == "dns:///model:50053"
    assert "container_name" not in default["services"]["model"]  # a fixed name would forbid --scale


def test_publish_address_and_settings_come_from_the_environment() -> None:
    config = resolved_config(COMPOSE_FILE, env={"GROK_PUBLISH_ADDRESS": "0.0.0.0", "GROK_MODEL_SLOTS": "16",
                                               "GROK_GATEWAY_PUBLISHED_PORT": "8443",
                                               "GROK_GATEWAY_HTTP_PUBLISHED_PORT": "8080", "GROK_API_KEY": "k"})
    gateway = config["services"]["gateway"]["ports"]
    assert {(p["host_ip"], p["published"]) for p in gateway} == {("0.0.0.0", "8443"), ("0.0.0.0", "8080"),
                                                                  ("0.0.0.0", "9090")}
    assert config["services"]["gateway"]["environment"]["GROK_GATEWAY_API_KEY"] == "k"
    assert config["services"]["model"]["environment"]["GROK_MODEL_SLOTS"] == "16"


def test_default_profile_serves_the_committed_demo_model_copied_into_the_image(default: dict) -> None:
    model = default["services"]["model"]["environment"]
    assert model["GROK_MODEL_CONFIG"] == "/app/demo/config.json"
    assert model["GROK_MODEL_CHECKPOINT"] == "/app/demo/checkpoint"
    assert default["services"]["tokenizer"]["environment"]["GROK_TOKENIZER_MODEL"] == "/app/demo/tokenizer.model"
    # The image trains and generates nothing: demo/ enters the build context and the runtime copies the context;
    # the tools that built it (demo_build/, optax) stay out.
    assert "demo" in build_context_entries() and "demo_build" not in build_context_entries()
    assert (ROOT / "demo" / "tokenizer.model").is_file() and (ROOT / "demo" / "checkpoint" / "ckpt-0").is_dir()
    runtime = stage(dockerfile_instructions(), "runtime")
    assert ("WORKDIR", "/app") in runtime and ("COPY", ". .") in runtime
    assert not any(kw == "RUN" and "demo_build" in rest for kw, rest in dockerfile_instructions())


def test_grok1_mounts_weights_read_only_and_reserves_gpus(grok1: dict) -> None:
    model, tokenizer = grok1["services"]["model"], grok1["services"]["tokenizer"]
    mounts = {v["target"]: v for v in model["volumes"] + tokenizer["volumes"] if v["type"] == "bind"}
    assert mounts["/models/checkpoints"]["source"] == str(ROOT / "checkpoints")
    assert mounts["/models/tokenizer.model"]["source"] == str(ROOT / "tokenizer.model")
    assert all(m["read_only"] and m["bind"]["create_host_path"] is False for m in mounts.values())
    assert model["environment"]["GROK_MODEL_CHECKPOINT"] == "/models/checkpoints"
    assert model["environment"]["GROK_MODEL_CONFIG"] == "grok-1"
    assert tokenizer["environment"]["GROK_TOKENIZER_MODEL"] == "/models/tokenizer.model"
    devices = model["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 8, "capabilities": ["gpu"]}]
    assert model["build"]["args"]["JAX_CUDA"] == "cuda12" and model["environment"]["JAX_PLATFORMS"] == "cuda"
    assert model["image"] != grok1["services"]["gateway"]["image"]  # the CPU services keep the small image


def test_image_runs_as_non_root_and_health_checks_over_grpc() -> None:
    runtime = stage(dockerfile_instructions(), "runtime")
    users = [rest for kw, rest in runtime if kw == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    (health,) = [rest for kw, rest in runtime if kw == "HEALTHCHECK"]
    assert "python -m serving_common.healthcheck 127.0.0.1:${PORT}" in health


def test_runtime_stage_installs_nothing_and_the_context_is_an_allowlist() -> None:
    # Build tools and pip caches stay in the deps stage: the runtime stage installs nothing itself.
    runtime = stage(dockerfile_instructions(), "runtime")
    runs = " ".join(rest for kw, rest in runtime if kw == "RUN")
    assert "pip" not in runs and "apt-get" not in runs
    rules = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "**", "the build context must start from nothing and allow only source folders"
    allowed = [line[1:] for line in rules if line.startswith("!")]
    assert not any(a.startswith(("checkpoints", "artifacts", ".venv", "tokenizer.model")) for a in allowed)


def test_dependencies_are_installed_from_the_pinned_pyproject() -> None:
    deps = stage(dockerfile_instructions(), "deps")
    assert ("COPY", "pyproject.toml ./") in deps
    (run,) = [rest for kw, rest in deps if kw == "RUN"]
    assert "tomllib" in run and "pip install --no-cache-dir -r requirements.txt" in run


@pytest.mark.parametrize("jax_cuda, jax_line", [("", "jax==0.10.2"), ("cuda12", "jax[cuda12]==0.10.2")])
def test_deps_stage_pins_jax_and_adds_the_cuda_extra_only_when_asked(
        tmp_path: pathlib.Path, jax_cuda: str, jax_line: str) -> None:
    (run,) = [rest for kw, rest in stage(dockerfile_instructions(), "deps") if kw == "RUN"]
    (script,) = [cmd for cmd in shell_commands(run) if cmd[:2] == ["python", "-c"]]
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    done = subprocess.run([sys.executable, "-c", script[2]], cwd=tmp_path, env={"JAX_CUDA": jax_cuda},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pins = (tmp_path / "requirements.txt").read_text().split()
    assert jax_line in pins and "jaxlib==0.10.2" in pins and "grpcio==1.85.1" in pins
    assert all("==" in pin for pin in pins)


def test_build_context_holds_every_package_of_the_project() -> None:
    # The editable install would hide a package missing from the image in local runs: check by name.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    allowed = build_context_entries()
    assert [p for p in packages if p not in allowed] == []
    assert "configs" in allowed and "demo" in allowed  # the model service reads demo/config.json, presets in configs/


def test_model_replicas_renew_gateway_connections_so_scaled_replicas_get_traffic(default: dict) -> None:
    # Without a maximum connection age the gateway would resolve `model` again only on a failure.
    assert default["services"]["model"]["environment"]["GROK_MODEL_MAX_CONNECTION_AGE_SECONDS"] == "30"


@pytest.fixture(scope="module")
def multiprocess() -> dict:
    return resolved_config(COMPOSE_FILE, env={"COMPOSE_PROFILES": "multiprocess"})


def test_multiprocess_profile_is_off_by_default_and_passes_compose_config(default: dict) -> None:
    assert set(default["services"]) == set(SERVICES)
    done = run_compose((COMPOSE_FILE,), "--profile", "multiprocess", "config", "-q")
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_multiprocess_profile_runs_one_replica_as_two_numbered_processes(multiprocess: dict) -> None:
    services = multiprocess["services"]
    leader, worker = services["model-leader"], services["model-worker"]
    model = services["model"]["environment"]
    group = {"GROK_MODEL_COORDINATOR", "GROK_MODEL_NUM_PROCESSES", "GROK_MODEL_PROCESS_ID", "GROK_MODEL_MESH",
             "GROK_MODEL_METRICS_PORT"}
    for process_id, svc in enumerate((leader, worker)):
        env = svc["environment"]
        assert env["GROK_MODEL_COORDINATOR"] == "model-leader:8476"
        assert (env["GROK_MODEL_NUM_PROCESSES"], env["GROK_MODEL_PROCESS_ID"]) == ("2", str(process_id))
        assert env["GROK_MODEL_MESH"] == "1,2"  # one CPU device per process: the model axis spans both
        assert {k: v for k, v in env.items() if k not in group} == {k: v for k, v in model.items() if k not in group}
        assert svc["command"] == services["model"]["command"] and svc["init"] is True
    assert "8476" in leader["expose"]
    # Process 0 answers to `model`, the name the gateway balances over; the follower serves nothing.
    assert leader["networks"]["default"]["aliases"] == ["model"]
    assert leader["healthcheck"]["test"] == services["model"]["healthcheck"]["test"]
    assert worker["healthcheck"] == {"disable": True} and worker["environment"]["GROK_MODEL_METRICS_PORT"] == "0"
    assert worker["depends_on"]["model-leader"]["condition"] == "service_started"


def test_multiprocess_profile_settings_parse_with_the_model_service_flags(
        multiprocess: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from model_service.__main__ import parser

    for process_id, name in enumerate(("model-leader", "model-worker")):
        with monkeypatch.context() as m:
            for key, value in multiprocess["services"][name]["environment"].items():
                m.setenv(key, str(value))
            args = parser().parse_args([])
        assert (args.coordinator, int(args.num_processes), int(args.process_id)) == ("model-leader:8476", 2, process_id)


@pytest.fixture(scope="module")
def tracing() -> dict:
    return resolved_config(COMPOSE_FILE, env={"COMPOSE_PROFILES": "tracing", "GROK_OTLP_ENDPOINT": "http://jaeger:4317"})


def test_tracing_profile_is_off_by_default_and_passes_compose_config(default: dict) -> None:
    assert "jaeger" not in default["services"]
    for name in SERVICES:
        assert default["services"][name]["environment"][f"GROK_{name.upper()}_OTLP_ENDPOINT"] == ""  # no traces
    done = run_compose((COMPOSE_FILE,), "--profile", "tracing", "config", "-q")
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_tracing_profile_runs_jaeger_with_its_ui_and_otlp_port_on_the_publish_address(tracing: dict) -> None:
    jaeger = tracing["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/jaeger:2.")  # v2: OTLP built in, one image
    assert jaeger["environment"]["JAEGER_LISTEN_HOST"] == "0.0.0.0"
    assert {(p["host_ip"], p["published"], p["target"]) for p in jaeger["ports"]} == {
        ("127.0.0.1", "16686", 16686), ("127.0.0.1", "4317", 4317)}


def test_every_service_sends_traces_to_the_endpoint_given_and_parses_it_with_its_flag(
        tracing: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.__main__ import parse_config
    from model_service.__main__ import parser
    from tokenizer_service.__main__ import parse_args

    parse = {"tokenizer": lambda: parse_args([]).otlp_endpoint, "gateway": lambda: parse_config([]).otlp_endpoint,
             "model": lambda: parser().parse_args([]).otlp_endpoint}
    for name in SERVICES:
        env = tracing["services"][name]["environment"]
        assert env[f"GROK_{name.upper()}_OTLP_ENDPOINT"] == "http://jaeger:4317"
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, str(value))
            assert parse[name]() == "http://jaeger:4317"
