"""Run a compose project's containers as local processes, in depends_on order, gated by health checks.

Each container's health check is the compose file's own `healthcheck.test` command (localized), run
until it exits 0 within the compose file's start_period + retries * interval, the way Docker decides
`service_healthy` before starting dependents. Processes run in the local stand-in for the image's
WORKDIR, so they see only what the image holds.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Protocol

from serving_common.processes import terminate
from tests.deploy.compose import LocalService, seconds, start_order

POLL_SECONDS = 0.5


class Command(Protocol):
    """What starts a container's process: a compose service (LocalService) or a pod (LocalPod)."""

    @property
    def module(self) -> str: ...

    @property
    def args(self) -> tuple[str, ...]: ...


class Process:
    """One container's process: `python -m module args`, output (JSON logs) kept in a file."""

    def __init__(self, container: Command, env: Mapping[str, str], workdir: pathlib.Path,
                 log_path: pathlib.Path) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", container.module, *container.args], cwd=workdir,
                                         env=dict(env), stdout=log, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float) -> int:
        """SIGTERM (what `docker compose down` sends), then SIGKILL after `timeout` seconds."""
        return terminate(self.proc, timeout)


class LocalStack:
    """The running containers; `start()` brings them up wave by wave, `stop()` sends SIGTERM."""

    def __init__(self, containers: list[LocalService], healthchecks: Mapping[str, Mapping],
                 base_env: Mapping[str, str], workdir: pathlib.Path, log_dir: pathlib.Path) -> None:
        self.containers = containers
        self.healthchecks = healthchecks
        self.base_env = dict(base_env)
        self.workdir = workdir
        self.log_dir = log_dir
        self.procs: dict[tuple[str, int], Process] = {}
        self.exit_codes: dict[tuple[str, int], int] = {}

    def get(self, name: str, replica: int = 0) -> LocalService:
        return next(c for c in self.containers if c.name == name and c.replica == replica)

    def start(self) -> "LocalStack":
        for wave in start_order(self.containers):
            for container in wave:
                log_path = self.log_dir / f"{container.name}-{container.replica}.log"
                self.procs[(container.name, container.replica)] = Process(
                    container, self.base_env | container.env, self.workdir, log_path)
            for container in wave:
                self.wait_healthy(container)
        return self

    def healthcheck(self, name: str, replica: int = 0) -> subprocess.CompletedProcess[str]:
        """The container's compose health check, once (Docker kills it after its timeout; so do we)."""
        container = self.get(name, replica)
        timeout = seconds(self.healthchecks[name]["timeout"])
        try:
            return subprocess.run(list(container.healthcheck), cwd=self.workdir, capture_output=True, text=True,
                                  timeout=timeout, env=self.base_env | container.env)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(container.healthcheck, 1, "", f"timed out after {timeout}s")

    def wait_healthy(self, container: LocalService) -> None:
        check = self.healthchecks[container.name]
        deadline = time.monotonic() + seconds(check["start_period"]) + check["retries"] * seconds(check["interval"])
        proc = self.procs[(container.name, container.replica)]
        last = None
        while time.monotonic() < deadline:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"{container.name}[{container.replica}] exited with {proc.proc.returncode}:\n"
                                   f"{proc.logs()[-4000:]}")
            last = self.healthcheck(container.name, container.replica)
            if last.returncode == 0:
                return
            time.sleep(POLL_SECONDS)
        raise TimeoutError(f"{container.name}[{container.replica}] never passed its compose health check "
                           f"{container.healthcheck}: {last and last.stdout}\n{proc.logs()[-4000:]}")

    def logs(self, name: str, replica: int = 0) -> str:
        return self.procs[(name, replica)].logs()

    def stop(self) -> dict[tuple[str, int], int]:
        """SIGTERM in reverse start order (dependents first, as compose does); the exit codes."""
        for key in reversed(list(self.procs)):
            if key not in self.exit_codes:
                self.exit_codes[key] = self.procs[key].terminate(timeout=60)
        return self.exit_codes
