"""The whole stack over unix sockets, as on a host that allows no TCP: the tokenizer, model and gateway services
each listen on `--uds PATH` in one directory, the gateway dials `unix:` targets, the HTTP API listens on
`--http-uds`, and the Python client, the CLI and an HTTP client reach them there. No service holds a TCP or
UDP socket; every socket file is owner-only and gone once its service stopped."""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import re
import socket
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from gateway.client import GatewayClient
from serving_common.processes import unix_endpoint
from tests.procs import GOLDEN, ROOT, Service, grpcurl
from tests.waiting import wait_until


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix socket file (what `curl --unix-socket PATH` does)."""

    def __init__(self, path: str, timeout: float = 60.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def http_call(path: str, method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    connection = UnixHTTPConnection(path)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        connection.request(method, url, body=payload, headers={"content-type": "application/json"})
        reply = connection.getresponse()
        return reply.status, reply.read().decode()
    finally:
        connection.close()


def inet_sockets(pid: int) -> list[str]:
    """The TCP/UDP sockets (IPv4 or IPv6) process `pid` holds open."""
    inodes = set()
    for name in ("tcp", "tcp6", "udp", "udp6"):
        table = pathlib.Path(f"/proc/{pid}/net/{name}")
        if table.exists():
            for line in table.read_text().splitlines()[1:]:
                inodes.add((name, line.split()[9]))
    held = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if match:
            held.add(match.group(1))
    return sorted(f"{name} inode {inode}" for name, inode in inodes if inode in held)


class UnixStack:
    """tokenizer, golden model and gateway on socket files in `directory`."""

    def __init__(self, directory: pathlib.Path, cache: str) -> None:
        self.directory = directory
        tokenizer, model, gateway = (unix_endpoint(directory, name) for name in ("tokenizer", "model", "gateway"))
        self.http_uds = str(directory / "http.sock")
        self.tokenizer = Service("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"), *tokenizer.args],
                                 0, log_dir=directory)
        self.model = Service("model_service", [
            "--config", str(GOLDEN / "config.json"), "--checkpoint", str(GOLDEN / "checkpoint"), "--slots", "2",
            "--compile-cache", cache], 0, log_dir=directory, env={"GROK_MODEL_UDS": model.args[1]})
        self.gateway = Service("gateway", ["--tokenizer", tokenizer.address, "--model", model.address,
                                           "--http-uds", self.http_uds, *gateway.args], 0, log_dir=directory)
        for service, endpoint in ((self.tokenizer, tokenizer), (self.model, model), (self.gateway, gateway)):
            service.address = endpoint.address
        self.services = (self.gateway, self.model, self.tokenizer)

    def wait(self) -> None:
        for service in reversed(self.services):
            service.wait_serving(600)

    def stop(self) -> list[int]:
        return [service.terminate() for service in self.services]


@pytest.fixture(scope="module")
def stack(jax_cache: str) -> Iterator[UnixStack]:
    # A short directory: socket paths have at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="grok-uds", dir="/tmp") as name:
        running = UnixStack(pathlib.Path(name), jax_cache)
        try:
            running.wait()
            yield running
        finally:
            running.stop()


def test_client_generates_through_the_gateway_socket(stack: UnixStack) -> None:
    with GatewayClient(stack.gateway.address, timeout=120) as client:
        messages = list(client.generate("The", max_tokens=6, ignore_eos=True))
    assert messages[-1].usage.completion_tokens == 6
    assert "".join(m.text for m in messages)


def test_cli_streams_over_a_unix_address(stack: UnixStack) -> None:
    run = subprocess.run([sys.executable, "-m", "gateway.client", "The", "--max-tokens", "4", "--ignore-eos",
                          "--address", stack.gateway.address], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "4 completion" in run.stderr


def test_http_api_on_its_socket(stack: UnixStack) -> None:
    status, _ = http_call(stack.http_uds, "GET", "/health")
    assert status == 200
    status, body = http_call(stack.http_uds, "POST", "/v1/completions",
                             {"model": "grok-1", "prompt": "The", "max_tokens": 5, "ignore_eos": True})
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 5


def test_no_service_holds_an_inet_socket(stack: UnixStack) -> None:
    """What a host that allows no TCP or UDP needs: listening and dialling over socket files only."""
    for service in stack.services:
        assert inet_sockets(service.proc.pid) == [], service.module


def test_socket_files_are_owner_only(stack: UnixStack) -> None:
    files = sorted(p.name for p in stack.directory.iterdir() if stat.S_ISSOCK(os.lstat(p).st_mode))
    assert files == ["gateway.sock", "http.sock", "model.sock", "tokenizer.sock"]
    for name in files:
        assert stat.S_IMODE(os.lstat(stack.directory / name).st_mode) == 0o600, name


def test_a_second_gateway_on_the_same_socket_is_refused(stack: UnixStack) -> None:
    path = stack.gateway.address.removeprefix("unix:")
    second = Service("gateway", ["--tokenizer", stack.tokenizer.address, "--model", stack.model.address,
                                 "--http-port", "0", "--uds", path], 1, log_dir=stack.directory)
    assert second.proc.wait(120) == 2
    second.terminate()
    assert f"--uds: {path!r} is in use" in second.logs()
    with GatewayClient(stack.gateway.address, timeout=60) as client:  # the first gateway still serves
        assert client.complete("The", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_stopped_services_remove_their_sockets() -> None:
    """SIGTERM: the tokenizer service and a gateway (its gRPC and HTTP sockets) exit 0 and leave no file."""
    with tempfile.TemporaryDirectory(prefix="grok-uds", dir="/tmp") as name:
        directory = pathlib.Path(name)
        tokenizer = unix_endpoint(directory, "tokenizer")
        service = Service("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"), *tokenizer.args], 0,
                          log_dir=directory)
        service.address = tokenizer.address
        gateway = Service("gateway", ["--tokenizer", tokenizer.address, "--model", f"unix:{directory}/none.sock",
                                      "--http-uds", str(directory / "http.sock"),
                                      *unix_endpoint(directory, "gateway").args], 1, log_dir=directory)
        try:
            service.wait_serving(120)
            # Its "serving" line comes once both sockets are bound and SIGTERM drains it.
            wait_until(lambda: '"msg": "serving"' in gateway.logs(), 120, interval=0.1, message=gateway.logs)
            assert (directory / "http.sock").exists() and (directory / "gateway.sock").exists()
        finally:
            codes = [gateway.terminate(), service.terminate()]
        assert codes == [0, 0], gateway.logs()
        assert not [p.name for p in directory.iterdir() if p.name.endswith(".sock")]


def test_health_reflection_and_curl_reach_the_sockets(stack: UnixStack) -> None:
    """What docs/running.md shows: the healthcheck CLI on unix:PATH, grpcurl -unix (reflection) and
    curl --unix-socket."""
    model_path = stack.model.address.removeprefix("unix:")
    health = subprocess.run([sys.executable, "-m", "serving_common.healthcheck", stack.model.address], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert health.returncode == 0 and health.stdout.strip() == "SERVING", health
    listed = grpcurl("-plaintext", "-unix", model_path, "list")
    assert listed.returncode == 0 and "grok.model.v1.ModelService" in listed.stdout, listed
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    done = subprocess.run(["curl", "-s", "--unix-socket", stack.http_uds, "http://localhost/v1/completions", "-H",
                           "content-type: application/json", "-d",
                           '{"model": "grok-1", "prompt": "The", "max_tokens": 3}'],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["usage"]["completion_tokens"] >= 1, done
