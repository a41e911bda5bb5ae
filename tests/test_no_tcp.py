"""The stack on a host where no TCP or UDP socket can be made (the TPU host used for development), reproduced
with scripts/no_tcp.py's LD_PRELOAD shim: socket(AF_INET/AF_INET6) fails with EAFNOSUPPORT in every service
and client started here. The three services and a client work over unix sockets; a flag that needs TCP there
stops its service with a message naming the unix-socket flag to use instead."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from scripts.no_tcp import ShimUnavailable, environment, shim
from serving_common.processes import unix_endpoint
from tests.procs import GOLDEN, ROOT, Service
from tests.test_uds_stack import UnixHTTPConnection, http_call
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def no_tcp() -> dict[str, str]:
    """The environment variables that make a child's TCP/UDP sockets impossible."""
    try:
        library = shim()
    except ShimUnavailable as error:
        pytest.skip(f"cannot build the no-TCP shim here: {error}")
    return {"LD_PRELOAD": environment(library, {})["LD_PRELOAD"]}


@pytest.fixture()
def sockets() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="grok-notcp", dir="/tmp") as name:  # short: paths <= 107 bytes
        yield pathlib.Path(name)


def python(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def test_the_shim_refuses_inet_sockets_and_keeps_unix_ones(no_tcp: dict[str, str]) -> None:
    probe = ("import socket\n"
             "for family in (socket.AF_INET, socket.AF_INET6):\n"
             "    try: socket.socket(family)\n"
             "    except OSError as e: print(e.errno)\n"
             "socket.socket(socket.AF_UNIX).close(); print('unix')\n")
    run = python(["-c", probe], no_tcp)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["97", "97", "unix"]  # EAFNOSUPPORT twice


def started_without_tcp(module: str, args: list[str], env: dict[str, str], directory: pathlib.Path) -> Service:
    return Service(module, args, 0, env=env, log_dir=directory)


def test_three_services_and_a_client_without_tcp(no_tcp: dict[str, str], sockets: pathlib.Path,
                                                 jax_cache: str) -> None:
    tokenizer, model, gateway = (unix_endpoint(sockets, name) for name in ("tokenizer", "model", "gateway"))
    http, model_metrics = str(sockets / "http.sock"), str(sockets / "model-metrics.sock")
    services = [
        started_without_tcp("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"), *tokenizer.args],
                            no_tcp, sockets),
        started_without_tcp("model_service", ["--config", str(GOLDEN / "config.json"), "--checkpoint",
                                              str(GOLDEN / "checkpoint"), "--slots", "2", "--compile-cache",
                                              jax_cache, "--metrics-uds", model_metrics, *model.args], no_tcp, sockets),
        started_without_tcp("gateway", ["--tokenizer", tokenizer.address, "--model", model.address,
                                        "--http-uds", http, "--model-metrics", f"unix:{model_metrics}",
                                        *gateway.args], no_tcp, sockets)]
    try:
        for service, endpoint in zip(services, (tokenizer, model, gateway)):
            service.address = endpoint.address
            service.wait_serving(600)
        health = python(["-m", "serving_common.healthcheck", gateway.address], no_tcp, timeout=60)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING", health
        cli = python(["-m", "gateway.client", "The", "--max-tokens", "4", "--ignore-eos", "--address",
                      gateway.address], no_tcp)
        assert cli.returncode == 0, cli.stderr
        assert "4 completion" in cli.stderr
        status, body = http_call(http, "POST", "/v1/completions",
                                 {"model": "grok-1", "prompt": "The", "max_tokens": 3, "ignore_eos": True})
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 3
        # /metrics without TCP: the gateway's on its HTTP socket, with the model's scraped from its socket.
        status, exposition = http_text(http, "/metrics")
        assert status == 200
        replica = f'replica="unix:{model_metrics}"'
        assert f"grok_gateway_model_metrics_up{{{replica}}} 1.0" in exposition, exposition[-2000:]
        assert f"grok_model_generated_tokens_total{{{replica}}} 7.0" in exposition  # 4 + 3 tokens
    finally:
        codes = [service.terminate() for service in reversed(services)]
    assert codes == [0, 0, 0], [s.logs()[-2000:] for s in services]
    for service in services:
        errors = [r for r in service.log_records() if r.get("level") == "error"]
        assert errors == [], (service.module, errors)


def http_text(path: str, url: str) -> tuple[int, str]:
    connection = UnixHTTPConnection(path)
    try:
        connection.request("GET", url)
        reply = connection.getresponse()
        return reply.status, reply.read().decode()
    finally:
        connection.close()


def startup_error(service: Service) -> str:
    assert service.proc.wait(120) == 2, service.logs()[-2000:]
    service.terminate()
    failed = [r for r in service.log_records() if r.get("msg") == "startup failed"]
    assert failed, service.logs()[-2000:]
    return failed[0]["error"]


def test_a_grpc_port_without_tcp_names_uds(no_tcp: dict[str, str], sockets: pathlib.Path) -> None:
    error = startup_error(started_without_tcp("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"),
                                                                    "--port", "0"], no_tcp, sockets))
    assert "allows no TCP" in error and "--uds PATH" in error, error


def test_the_gateway_http_port_without_tcp_names_http_uds(no_tcp: dict[str, str], sockets: pathlib.Path) -> None:
    """`--uds` alone leaves the HTTP API on its default TCP port 8000: that is refused with the way out."""
    gateway = unix_endpoint(sockets, "gateway")
    error = startup_error(started_without_tcp("gateway", ["--tokenizer", f"unix:{sockets}/t.sock", "--model",
                                                          f"unix:{sockets}/m.sock", *gateway.args], no_tcp, sockets))
    assert error.startswith("--http-port 8000:") and "allows no TCP" in error, error
    assert "--http-uds PATH" in error and "--http-port 0" in error, error
    assert not (sockets / "gateway.sock").exists()


def test_a_metrics_port_without_tcp_says_so(no_tcp: dict[str, str], sockets: pathlib.Path) -> None:
    gateway = unix_endpoint(sockets, "gateway")
    error = startup_error(started_without_tcp("gateway", ["--tokenizer", f"unix:{sockets}/t.sock", "--model",
                                                          f"unix:{sockets}/m.sock", "--http-uds",
                                                          str(sockets / "http.sock"), "--metrics-port", "9464",
                                                          *gateway.args], no_tcp, sockets))
    assert error.startswith("--metrics-port 9464:") and "allows no TCP" in error, error
    assert "--http-uds" in error, error  # where the gateway's /metrics is served instead


def test_run_stack_serves_on_a_socket_directory_without_tcp(no_tcp: dict[str, str], sockets: pathlib.Path,
                                                            jax_cache: str) -> None:
    """`make run ARGS="--uds-dir DIR"` on such a host: SERVING, the sample completion, a clean stop."""
    directory = sockets / "stack"
    proc = subprocess.Popen([sys.executable, "scripts/run_stack.py", "--uds-dir", str(directory), "--max-tokens", "4",
                             "--compile-cache", jax_cache, "--log-format", "json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **no_tcp, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        wait_until(lambda: _read_until(proc, lines, "run_stack: serving;"), 600, interval=0.0,
                   message=lambda: "".join(lines)[-3000:])
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=120)
    lines.append(rest)
    text = "".join(lines)
    assert proc.returncode == 0, text[-3000:]
    assert "[finish: length; tokens:" in text and "4 completion" in text, text[-3000:]
    assert '"level": "error"' not in text, text[-3000:]


def _read_until(proc: subprocess.Popen[str], lines: list[str], marker: str) -> bool:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line and proc.poll() is not None:
        raise AssertionError(f"run_stack exited with {proc.returncode}: {''.join(lines)[-3000:]}")
    lines.append(line)
    return marker in line


def test_traces_reach_a_collector_on_a_unix_socket(no_tcp: dict[str, str], sockets: pathlib.Path) -> None:
    """`--otlp-endpoint unix:PATH`: a collector (or an agent's socket) reached without TCP."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from grok.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
    from tests.gateway.test_tracing_e2e import EXPORT_NOW, Collector

    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    server.add_insecure_port(f"unix:{sockets}/otlp.sock")
    server.start()
    tokenizer = unix_endpoint(sockets, "tokenizer")
    service = started_without_tcp("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"), *tokenizer.args,
                                                        "--otlp-endpoint", f"unix:{sockets}/otlp.sock"],
                                  {**no_tcp, **EXPORT_NOW}, sockets)
    service.address = tokenizer.address
    try:
        service.wait_serving(120)
        with grpc.insecure_channel(tokenizer.address) as channel:
            tokenizer_pb2_grpc.TokenizerServiceStub(channel).Encode(tokenizer_pb2.EncodeRequest(text="The"), timeout=30)
        wait_until(lambda: any(s.service == "tokenizer" and s.name.endswith("/Encode") for s in collector.spans()),
                   60, interval=0.1, message=service.logs)
    finally:
        code = service.terminate()
        server.stop(None)
    assert code == 0, service.logs()[-2000:]
