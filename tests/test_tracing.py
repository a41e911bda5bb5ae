"""serving_common.tracing without a collector: the flag, what is (not) installed, context over metadata,
the trace id in log lines, and a stop that a silent collector cannot hold up. tests/gateway/test_tracing_e2e.py follows one request through the stack."""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import socket
import subprocess
import sys
import threading

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from gateway.__main__ import parse_config
from serving_common import tracing
from serving_common.logs import JsonFormatter
from grok.tokenizer.v1.tokenizer_pb2 import EncodeRequest
from grok.tokenizer.v1.tokenizer_pb2_grpc import TokenizerServiceStub
from tests.procs import GOLDEN, ROOT, Service, free_port
from tests.waiting import wait_until
from tokenizer_service.__main__ import parse_args as tokenizer_args

GATEWAY = ["--tokenizer", "127.0.0.1:1", "--model", "127.0.0.1:2"]


def test_tracing_is_off_by_default_and_the_endpoint_flag_reads_host_port_as_plaintext() -> None:
    assert parse_config(GATEWAY).otlp_endpoint is None
    assert parse_config([*GATEWAY, "--otlp-endpoint", "jaeger:4317"]).otlp_endpoint == "http://jaeger:4317"
    assert parse_config([*GATEWAY, "--otlp-endpoint", "https://otel.example:4317"]).otlp_endpoint == \
        "https://otel.example:4317"
    # A collector's (or an agent's) unix socket, where TCP is not allowed: gRPC's target, plaintext.
    assert parse_config([*GATEWAY, "--otlp-endpoint", "unix:///tmp/otel.sock"]).otlp_endpoint == "unix:/tmp/otel.sock"


def test_the_endpoint_comes_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROK_TOKENIZER_OTLP_ENDPOINT", "http://collector:4317")
    assert tokenizer_args(["--model", "x.model"]).otlp_endpoint == "http://collector:4317"


def test_an_endpoint_that_is_not_http_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config([*GATEWAY, "--otlp-endpoint", "ftp://collector:4317"])
    assert "--otlp-endpoint" in capsys.readouterr().err


def test_without_an_endpoint_no_provider_or_exporter_is_installed_and_the_sdk_is_not_loaded() -> None:
    # A fresh interpreter: the global tracer provider can be set once per process.
    script = """
import json, sys, threading
from opentelemetry import trace
from serving_common import logs, tracing
from gateway.__main__ import parse_config
config = parse_config(["--tokenizer", "127.0.0.1:1", "--model", "127.0.0.1:2"])
provider = tracing.configure("gateway", config.otlp_endpoint)
span = tracing.start_call("/grok.gateway.v1.GatewayService/Generate",
                          (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),), "r1")
print(json.dumps({"provider": provider is None, "enabled": tracing.enabled(),
                  "global": type(trace.get_tracer_provider()).__name__, "span": span is trace.INVALID_SPAN,
                  "current": trace.get_current_span() is trace.INVALID_SPAN,
                  "sdk": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")),
                  "exporter": any(m.startswith("opentelemetry.exporter") for m in sys.modules),
                  "threads": sorted(t.name for t in threading.enumerate())}))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state = json.loads(out.stdout)
    assert state == {"provider": True, "enabled": False, "global": "ProxyTracerProvider", "span": True,
                     "current": True, "sdk": [], "exporter": False, "threads": ["MainThread"]}


def test_a_span_context_travels_in_grpc_metadata_as_traceparent() -> None:
    span = TracerProvider().get_tracer("test").start_span("caller")
    metadata = tracing.with_context((("x-request-id", "r1"),), span)
    assert metadata[0] == ("x-request-id", "r1")
    sent = dict(metadata[1:])
    context = span.get_span_context()
    assert sent["traceparent"] == f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    received = trace.get_current_span(tracing.extract_metadata(metadata)).get_span_context()
    assert (received.trace_id, received.span_id, received.is_remote) == (context.trace_id, context.span_id, True)


def test_a_span_without_a_valid_context_adds_no_metadata() -> None:
    assert tracing.with_context((("x-request-id", "r1"),), trace.INVALID_SPAN) == (("x-request-id", "r1"),)


def test_an_http_clients_traceparent_header_is_read_and_a_malformed_one_ignored() -> None:
    header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    context = trace.get_current_span(tracing.extract({"traceparent": header})).get_span_context()
    assert (f"{context.trace_id:032x}", f"{context.span_id:016x}") == ("0af7651916cd43dd8448eb211c80319c",
                                                                       "b7ad6b7169203331")
    assert not trace.get_current_span(tracing.extract({"traceparent": "00-nonsense"})).get_span_context().is_valid


def _log_entry(formatter: JsonFormatter) -> dict:
    record = logging.LogRecord("test", logging.INFO, __file__, 1, "hello", None, None)
    return json.loads(formatter.format(record))


def test_log_lines_carry_the_trace_id_of_the_current_span_beside_the_request_id() -> None:
    formatter = JsonFormatter("gateway")
    assert "trace_id" not in _log_entry(formatter)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        entry = _log_entry(formatter)
    assert entry["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert "request_id" in entry


def test_sigterm_with_a_collector_that_never_answers_ends_within_the_grace_period(tmp_path: pathlib.Path) -> None:
    """The collector accepts the exporter's connection and never answers: the service still stops, exit 0, within
    its grace period (10 s), dropping the spans it could not send and saying so."""
    accepted: list[socket.socket] = []
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        threading.Thread(target=lambda: [accepted.append(silent.accept()[0]) for _ in iter(int, 1)],
                         daemon=True).start()
        port = free_port()
        service = Service("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"), "--host", "127.0.0.1",
                                                "--port", str(port), "--grace-seconds", "10",
                                                "--otlp-endpoint", f"http://127.0.0.1:{silent.getsockname()[1]}"],
                          port, env={"OTEL_BSP_SCHEDULE_DELAY": "50"}, log_dir=tmp_path)
        try:
            service.wait_serving(60)
            with grpc.insecure_channel(service.address) as channel:
                TokenizerServiceStub(channel).Encode(EncodeRequest(text="a span to export"), timeout=10)
            wait_until(lambda: accepted, 30, interval=0.05, message="the exporter never connected to the collector")
            service.proc.send_signal(signal.SIGTERM)
            assert service.proc.wait(timeout=10) == 0  # the grace period is the bound
        finally:
            service.kill()
            for conn in accepted:
                conn.close()
    assert "did not take the last spans in time" in service.logs()
