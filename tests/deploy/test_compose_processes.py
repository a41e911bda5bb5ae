"""docker-compose.yml run as local processes: its commands, environment, ports and health checks work.

Every container of the default compose project (with `--scale model=2`) is started with exactly the
command and environment compose would give it (container paths -> local folders, ports -> free
local ports, compose's DNS -> a local DNS server that answers `model` with two addresses), each
wave only after the compose health checks of the previous one pass. Then grpcurl drives the
gateway on the port the compose file publishes.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from tests.deploy.compose import (
    COMPOSE_FILE, dockerfile_instructions, image_environment, local_path, localize, resolved_config, stage)
from tests.deploy.conftest import compile_cache_volume
from tests.deploy.dns import DnsServer
from tests.deploy.stack import LocalStack
from tests.procs import grpcurl

pytestmark = pytest.mark.slow

MODEL_REPLICAS = 2


@pytest.fixture(scope="module")
def config() -> dict:
    return resolved_config(COMPOSE_FILE)


@pytest.fixture(scope="module")
def dns(config: dict) -> Iterator[DnsServer]:
    """Compose's embedded DNS: each service name -> one address per container (model: two)."""
    server = DnsServer({name: [f"127.0.0.{i + 1}" for i in range(MODEL_REPLICAS if name == "model" else 1)]
                        for name in config["services"]})
    yield server
    server.close()


@pytest.fixture(scope="module")
def stack(config: dict, dns: DnsServer, image_app: pathlib.Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    volumes = tmp_path_factory.mktemp("volumes")
    paths = {"/app": image_app}
    for svc in config["services"].values():
        for volume in svc.get("volumes", []):
            if volume["type"] == "volume":
                paths[volume["target"]] = (compile_cache_volume() if volume["source"] == "compile-cache"
                                           else volumes / volume["source"])
    containers = localize(config, paths, dns_authority=f"127.0.0.1:{dns.port}", scale={"model": MODEL_REPLICAS})
    image_env = {k: local_path(v, paths) for k, v in image_environment(dockerfile_instructions()).items()
                 if k != "PATH"}
    healthchecks = {name: svc["healthcheck"] for name, svc in config["services"].items()}
    (workdir,) = [local_path(rest, paths) for kw, rest in stage(dockerfile_instructions(), "runtime")
                  if kw == "WORKDIR"]
    # The process sees the host's environment (PATH to this venv's python) plus the image's and the service's.
    base_env = {**os.environ, **image_env, "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}
    running = LocalStack(containers, healthchecks, base_env, pathlib.Path(workdir), tmp_path_factory.mktemp("logs"))
    try:
        yield running.start()
    finally:
        running.stop()


def published_port(config: dict, stack: LocalStack, name: str, metrics: bool, replica: int = 0,
                   http: bool = False) -> str:
    """The local address of the gRPC (metrics, HTTP) port that `name` publishes in the compose file."""
    container = stack.get(name, replica)
    env = config["services"][name]["environment"]
    flag = "METRICS_PORT" if metrics else "HTTP_PORT" if http else "PORT"
    target = int(env[f"GROK_{name.upper()}_{flag}"])
    assert target in {p["target"] for p in config["services"][name]["ports"]}, f"{name} does not publish {target}"
    assert target in container.ports, f"{name} publishes {target} but listens on {sorted(container.ports)}"
    return f"{container.ip}:{container.ports[target]}"


@pytest.fixture(scope="module")
def gateway(config: dict, stack: LocalStack) -> str:
    """The gateway's gRPC address: the container port the compose file publishes, made local."""
    return published_port(config, stack, "gateway", metrics=False)


def snake_case(value: object) -> object:
    """JSON keys as the .proto spells them (grpcurl prints proto names or lowerCamelCase by version)."""
    if isinstance(value, dict):
        return {re.sub(r"(?<!^)([A-Z])", r"_\1", k).lower(): snake_case(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snake_case(v) for v in value]
    return value


def json_messages(text: str) -> list[dict]:
    """grpcurl prints one pretty-printed JSON object per message, back to back."""
    decoder, out, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        obj, i = decoder.raw_decode(text, i)
        out.append(snake_case(obj))
        while i < len(text) and text[i].isspace():
            i += 1
    return out


def metric(address: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets) on a Prometheus /metrics endpoint (0 if none yet)."""
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    declared = {f"# TYPE {name} ", f"# TYPE {name.removesuffix('_total')} "}
    assert any(d in body for d in declared), f"{name} is not exported by {address}/metrics"
    samples = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, flags=re.M)
    return sum(float(s) for s in samples)


def test_every_container_passes_its_compose_healthcheck(stack: LocalStack) -> None:
    for container in stack.containers:
        done = stack.healthcheck(container.name, container.replica)
        assert done.returncode == 0 and done.stdout.strip() == "SERVING", (container.name, done.stdout, done.stderr)


def test_grpcurl_lists_the_gateway_api_on_its_published_port(gateway: str) -> None:
    done = grpcurl("-plaintext", gateway, "list")
    assert done.returncode == 0, done.stderr
    assert {"grok.gateway.v1.GatewayService", "grpc.health.v1.Health"} <= set(done.stdout.split())


def test_grpcurl_generate_streams_a_completion_through_the_stack(gateway: str) -> None:
    request = {"prompt": "Serving on two cores", "sampling": {"max_tokens": 5, "ignore_eos": True, "seed": 11}}
    done = grpcurl("-plaintext", "-max-time", "120", "-d", json.dumps(request), gateway,
                   "grok.gateway.v1.GatewayService/Generate", timeout=150)
    assert done.returncode == 0, done.stderr
    messages = json_messages(done.stdout)
    last = messages[-1]
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    assert last["usage"]["completion_tokens"] == 5 and last["usage"]["prompt_tokens"] > 0
    assert sum(len(m.get("tokens", [])) for m in messages) == 5


def test_gateway_spreads_requests_over_model_replicas_found_through_the_service_name(
        config: dict, stack: LocalStack, dns: DnsServer, gateway: str) -> None:
    # The replica target is internal (GetInfo does not publish it): the gateway logs it at start.
    serving = [json.loads(line) for line in stack.logs("gateway").splitlines()
               if line.startswith("{") and '"serving"' in line]
    (address,) = serving[0]["models"]
    model_port = int(config["services"]["model"]["environment"]["GROK_MODEL_PORT"])
    assert address.endswith(f"/model:{stack.get('model').ports[model_port]}")
    assert ("model", 1) in dns.queries  # the gateway asked "DNS" for the A records of `model`
    for seed in range(6):
        request = {"prompt": f"replica {seed}", "sampling": {"max_tokens": 2, "ignore_eos": True, "seed": seed}}
        done = grpcurl("-plaintext", "-max-time", "120", "-d", json.dumps(request), gateway,
                       "grok.gateway.v1.GatewayService/Complete", timeout=150)
        assert done.returncode == 0, done.stderr
    for replica in range(MODEL_REPLICAS):
        tokens = metric(published_port(config, stack, "model", metrics=True, replica=replica),
                        "grok_model_generated_tokens_total")
        assert tokens > 0, f"model replica {replica} got no request"


def test_gateway_published_metrics_port_counts_requests(config: dict, stack: LocalStack, gateway: str) -> None:
    address = published_port(config, stack, "gateway", metrics=True)
    before = metric(address, "grok_gateway_requests_total")
    request = {"prompt": "count me", "sampling": {"max_tokens": 1}}
    assert grpcurl("-plaintext", "-max-time", "120", "-d", json.dumps(request), gateway,
                   "grok.gateway.v1.GatewayService/Complete", timeout=150).returncode == 0
    assert metric(address, "grok_gateway_requests_total") == before + 1


def test_openai_http_api_answers_on_the_published_http_port(config: dict, stack: LocalStack) -> None:
    address = published_port(config, stack, "gateway", metrics=False, http=True)
    body = json.dumps({"model": "grok-1", "prompt": "Serving over HTTP", "max_tokens": 3, "ignore_eos": True})
    request = urllib.request.Request(f"http://{address}/v1/completions", data=body.encode(),
                                     headers={"content-type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
    assert reply["object"] == "text_completion" and reply["usage"]["completion_tokens"] == 3
    assert reply["choices"][0]["finish_reason"] == "length"


def test_image_healthcheck_passes_against_the_gateway_on_port(stack: LocalStack, gateway: str) -> None:
    # The Dockerfile's own HEALTHCHECK (what `docker run` uses), with PORT set to the gateway's port.
    (health,) = [rest for kw, rest in stage(dockerfile_instructions(), "runtime") if kw == "HEALTHCHECK"]
    argv = json.loads(health.split(" CMD ", 1)[1])
    env = {"PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin",
           "PORT": gateway.rsplit(":", 1)[1]}
    done = subprocess.run(argv, cwd=stack.workdir, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "SERVING", done.stdout + done.stderr


def test_sigterm_stops_every_container_with_exit_code_0(stack: LocalStack) -> None:
    # Runs last in this module: it stops the stack, as `docker compose down` would.
    codes = stack.stop()
    assert codes == {key: 0 for key in codes} and len(codes) == len(stack.containers)
    stopped = stack.healthcheck("gateway")
    assert stopped.returncode != 0 and stopped.stdout.strip() == "NOT_SERVING"
