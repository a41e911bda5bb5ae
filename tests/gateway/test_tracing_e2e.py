"""Traces across the real stack: tokenizer_service + model_service (golden tiny Grok-1) + gateway, each
started with --otlp-endpoint pointing at an OTLP/gRPC collector this test runs on 127.0.0.1.

One request, over gRPC or over HTTP, must come back as one trace holding spans from all three
services, the tokenizer's and the model's calls parented on the gateway's spans, under the trace the
client sent in `traceparent` when it sent one.
"""

from __future__ import annotations

import json
import pathlib
import secrets
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gateway.client import completion_request
from grok.gateway.v1 import gateway_pb2_grpc
from tests.gateway.conftest import TOKENIZER_LIMITS, Stack, model_args, start_gateway
from tests.gateway.http_client import sse_events
from tests.procs import GOLDEN, Service, free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

# Spans leave a service in batches; a short delay keeps the test from waiting out the default 5 s.
EXPORT_NOW = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


def client_span() -> tuple[str, str]:
    """A client's own trace id and span id (each request its own trace)."""
    return secrets.token_hex(16), secrets.token_hex(8)


@dataclass(frozen=True)
class Span:
    service: str  # the service.name resource attribute
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]
    start_ns: int
    end_ns: int
    error: str  # the status message of a span that ended in error ("" otherwise)


def _value(any_value: object) -> object:
    which = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(any_value, which) if which else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802 (OTLP's name)
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                received += [Span(str(resource.get("service.name")), s.name, s.trace_id.hex(), s.span_id.hex(),
                                  s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                                  s.start_time_unix_nano, s.end_time_unix_nano,
                                  s.status.message if s.status.code == s.status.STATUS_CODE_ERROR else "")
                             for s in scope_spans.spans]
        with self._lock:
            self._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans() if s.trace_id == trace_id]


@dataclass
class TracedStack:
    stack: Stack
    collector: Collector
    http_url: str


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, jax_cache: str) -> Iterator[TracedStack]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    endpoint = f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    log_dir: pathlib.Path = tmp_path_factory.mktemp("traced")
    otlp = ("--otlp-endpoint", endpoint)
    port = free_port()
    tokenizer = Service("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model"), "--host", "127.0.0.1",
                                              "--port", str(port), *TOKENIZER_LIMITS, *otlp], port,
                        env=EXPORT_NOW, log_dir=log_dir)
    port = free_port()
    model = Service("model_service", [*model_args(port, free_port(), jax_cache), *otlp], port, env=EXPORT_NOW,
                    log_dir=log_dir)
    http_port = free_port()
    gateway = start_gateway(tokenizer.address, [model.address], log_dir, *otlp, http_port=http_port, env=EXPORT_NOW)
    stack = Stack(tokenizer, [model], gateway, http_port)
    try:
        for service in (tokenizer, model, gateway):
            service.wait_serving(600)
        yield TracedStack(stack, collector, stack.http_url)
    finally:
        stack.stop()
        server.stop(None)


# What a finished request's trace holds, at least (the gateway's request span is found by its usage).
EXPECTED = {("gateway", name) for name in ("validate", "encode", "detokenize", "model", "decode")} | {
    ("tokenizer", "grok.tokenizer.v1.TokenizerService/Encode"),
    ("tokenizer", "grok.tokenizer.v1.TokenizerService/DecodeStream"),
    ("model", "grok.model.v1.ModelService/Generate"), ("model", "queue"), ("model", "prefill"), ("model", "decode")}


def request_trace(collector: Collector, request_id: str) -> list[Span]:
    """The whole trace of the request `request_id`, once every span of its three services arrived."""
    def complete() -> list[Span] | None:
        tagged = [s for s in collector.spans() if s.attributes.get("grok.request_id") == request_id]
        trace_ids = {s.trace_id for s in tagged}
        assert len(trace_ids) <= 1, f"request {request_id} is in {len(trace_ids)} traces"
        if not trace_ids:
            return None
        spans = collector.trace(trace_ids.pop())
        finished = any(s.service == "gateway" and "gen_ai.usage.output_tokens" in s.attributes for s in spans)
        return spans if finished and EXPECTED <= {(s.service, s.name) for s in spans} else None
    return wait_until(complete, 30, message=lambda: f"the trace of {request_id} never completed: "
                      f"{sorted({(s.service, s.name) for s in collector.spans()})}")


def request_span(spans: list[Span]) -> Span:
    """The gateway's span that holds the request (usage on it)."""
    [span] = [s for s in spans if s.service == "gateway" and "gen_ai.usage.output_tokens" in s.attributes]
    return span


def check_linked(spans: list[Span]) -> None:
    """Spans from all three services in one trace; every tokenizer and model call span is the child of a
    gateway span; the gateway's stages are children of its request span."""
    assert {s.service for s in spans} == {"gateway", "tokenizer", "model"}
    assert len({s.trace_id for s in spans}) == 1
    by_id = {s.span_id: s for s in spans}
    gateway_ids = {s.span_id for s in spans if s.service == "gateway"}
    calls = [s for s in spans if s.service != "gateway" and s.attributes.get("rpc.system") == "grpc"]
    for call in calls:
        assert call.parent_id in gateway_ids, f"{call.service} {call.name} is not under a gateway span"
    parent_of = {(s.service, s.name): by_id[s.parent_id].name for s in spans if s.parent_id in by_id}
    assert parent_of[("tokenizer", "grok.tokenizer.v1.TokenizerService/Encode")] == "encode"
    assert parent_of[("tokenizer", "grok.tokenizer.v1.TokenizerService/DecodeStream")] == "detokenize"
    assert parent_of[("model", "grok.model.v1.ModelService/Generate")] == "model"
    [generate] = [s for s in spans if s.name == "grok.model.v1.ModelService/Generate"]
    stages = [next(s for s in spans if (s.service, s.name) == ("model", n)) for n in ("queue", "prefill", "decode")]
    for stage in stages:  # built afterwards from the model's timings: they must still nest, in order
        assert stage.parent_id == generate.span_id
        assert generate.start_ns <= stage.start_ns <= stage.end_ns <= generate.end_ns, stage.name
    assert [s.end_ns for s in stages[:2]] == [s.start_ns for s in stages[1:]]
    root = request_span(spans)
    for stage in ("validate", "encode", "detokenize", "model"):
        assert by_id[[s for s in spans if s.service == "gateway" and s.name == stage][0].parent_id] == root
    assert parent_of[("gateway", "decode")] == "model"


def test_a_grpc_request_is_one_trace_across_gateway_tokenizer_and_model(traced: TracedStack) -> None:
    with grpc.insecure_channel(traced.stack.address) as channel:
        reply = gateway_pb2_grpc.GatewayServiceStub(channel).Complete(
            completion_request("In the beginning", max_tokens=4, ignore_eos=True),
            metadata=(("x-request-id", "traced-grpc"),), timeout=120)
    spans = request_trace(traced.collector, "traced-grpc")
    check_linked(spans)
    root = request_span(spans)
    assert root.name == "grok.gateway.v1.GatewayService/Complete" and root.parent_id == ""  # the trace starts here
    assert root.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens == 4
    reasons = root.attributes["gen_ai.response.finish_reasons"]
    assert [v.string_value for v in reasons.values] == ["length"]  # type: ignore[union-attr]


def test_a_refused_request_shows_its_status_and_the_failing_stage(traced: TracedStack) -> None:
    with grpc.insecure_channel(traced.stack.address) as channel, pytest.raises(grpc.RpcError) as refused:
        gateway_pb2_grpc.GatewayServiceStub(channel).Complete(
            completion_request("In the beginning", max_tokens=4, temperature=-1.0),
            metadata=(("x-request-id", "traced-refused"),), timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def call() -> Span | None:
        return next((s for s in traced.collector.spans() if s.attributes.get("grok.request_id") == "traced-refused"
                     and s.name == "grok.gateway.v1.GatewayService/Complete"), None)
    span = wait_until(call, 30, message="the refused call's span never arrived")
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert span.error.startswith("INVALID_ARGUMENT: temperature")
    [validate] = [s for s in traced.collector.trace(span.trace_id) if s.name == "validate"]
    assert validate.parent_id == span.span_id and "temperature" in validate.error
    assert {s.service for s in traced.collector.trace(span.trace_id)} == {"gateway"}  # nothing reached a backend


def test_a_grpc_clients_traceparent_metadata_is_the_parent_of_the_gateway_span(traced: TracedStack) -> None:
    trace_id, span_id = client_span()
    with grpc.insecure_channel(traced.stack.address) as channel:
        gateway_pb2_grpc.GatewayServiceStub(channel).Complete(
            completion_request("In the beginning", max_tokens=2, ignore_eos=True),
            metadata=(("x-request-id", "traced-grpc-parent"), ("traceparent", f"00-{trace_id}-{span_id}-01")), timeout=120)
    spans = request_trace(traced.collector, "traced-grpc-parent")
    check_linked(spans)
    root = request_span(spans)
    assert (root.trace_id, root.parent_id) == (trace_id, span_id)


def http_completion(url: str, request_id: str, stream: bool, parent: tuple[str, str]) -> int:
    """POST a 3-token completion with the client's traceparent; the completion tokens the usage counts."""
    body = {"model": "grok-1", "prompt": "In the beginning", "max_tokens": 3, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    headers = {"content-type": "application/json", "traceparent": f"00-{parent[0]}-{parent[1]}-01",
               "x-request-id": request_id}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=120) as reply:
        text = reply.read().decode()
    last = json.loads(sse_events(text)[-2]) if stream else json.loads(text)  # streamed: the usage chunk, then [DONE]
    return last["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_http_clients_traceparent_is_honoured_across_the_stack(traced: TracedStack, stream: bool) -> None:
    request_id, (trace_id, span_id) = f"traced-http-{stream}", client_span()
    completion_tokens = http_completion(traced.http_url, request_id, stream, (trace_id, span_id))
    spans = request_trace(traced.collector, request_id)
    assert {s.trace_id for s in spans} == {trace_id}
    check_linked(spans)
    root = request_span(spans)
    assert root.name == "POST /v1/completions" and root.parent_id == span_id
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.usage.output_tokens"] == completion_tokens == 3
    assert root.attributes["gen_ai.request.model"] == "grok-1"


def test_log_lines_of_a_traced_request_carry_its_trace_id(traced: TracedStack) -> None:
    request_id = "traced-http-logs"
    http_completion(traced.http_url, request_id, True, client_span())
    spans = request_trace(traced.collector, request_id)
    trace_ids = {r.get("trace_id") for service in (traced.stack.gateway, traced.stack.models[0])
                 for r in service.log_records() if r.get("request_id") == request_id}
    assert trace_ids == {spans[0].trace_id}
