"""OpenTelemetry traces for the three services: `--otlp-endpoint`, the exporter, W3C trace context.

Off by default. With no endpoint nothing is installed: the OpenTelemetry API answers every call with its
no-op tracer (a span is a non-recording object that only carries the caller's context along) and the
SDK is not even imported. With an endpoint, a service sends its spans to an OTLP/gRPC collector (Jaeger,
the OpenTelemetry Collector, Tempo) in batches from a background thread, named by the `service.name`
resource attribute ("gateway", "tokenizer", "model"); `shutdown()` sends what is left when the service
stops, for at most SHUTDOWN_SECONDS.

Context travels as W3C `traceparent`/`tracestate`: the shared server interceptor opens each call's span
under the context in the call's metadata (serving_common.interceptor), the gateway puts its spans'
context into the metadata of its calls to the tokenizer and model services (`with_context`), and its
HTTP API reads the context from the request headers (`extract`).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from serving_common.flags import EnvArgumentParser
from serving_common.uds import path_of

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

TRACER_NAME = "grok-serve"
PROPAGATOR = TraceContextTextMapPropagator()
Metadata = Sequence[tuple[str, Any]]

_provider: TracerProvider | None = None
# The most a stopping service waits for its collector to take the last spans (out of its grace period).
SHUTDOWN_SECONDS = 2.0


def add_flag(parser: EnvArgumentParser) -> None:
    """`--otlp-endpoint` (and its environment variable) on a service's parser."""
    parser.add_env_argument("--otlp-endpoint", type=otlp_endpoint, default=None,
                            help="send OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://jaeger:4317 "
                                 "(https:// for TLS; unix:PATH for a collector's unix socket, plaintext, where TCP is "
                                 "not allowed; default: no tracing)")


def otlp_endpoint(raw: str) -> str | None:
    """The endpoint as the exporter reads it: plaintext unless https://, or a `unix:PATH` socket; "" means off."""
    raw = raw.strip()
    if not raw:
        return None
    if (path := path_of(raw)) is not None:
        if not path:
            raise argparse.ArgumentTypeError(f"{raw!r} names no socket file: unix:PATH")
        return f"unix:{path}"
    if "://" not in raw:
        raw = f"http://{raw}"  # the exporter would otherwise try TLS on a bare HOST:PORT
    parsed = urlparse(raw)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(f"{raw!r} is not http://HOST:PORT or https://HOST:PORT")
    return raw


def configure(service: str, endpoint: str | None) -> TracerProvider | None:
    """Install the SDK with an OTLP exporter to `endpoint` for `service`; with no endpoint, nothing.

    Called once from a service's __main__, before the server starts. The batch processor's settings
    (OTEL_BSP_SCHEDULE_DELAY and the rest), the exporter's (OTEL_EXPORTER_OTLP_TIMEOUT,
    OTEL_EXPORTER_OTLP_CERTIFICATE...) and the sampler (OTEL_TRACES_SAMPLER) are OpenTelemetry's own
    environment variables.
    """
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # shutdown() bounds the last export; the SDK's own exit hook would wait on it without a bound.
    provider = TracerProvider(resource=Resource.create({"service.name": service, "service.namespace": "grok-serve"}),
                              shutdown_on_exit=False)
    # A unix socket is a gRPC target as it stands; the exporter would otherwise want TLS for it.
    local = endpoint.startswith("unix:")
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True if local else None)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    log.info("tracing on", extra={"otlp_endpoint": endpoint})
    return provider


def install(provider: TracerProvider) -> None:
    """Make `provider` the process's tracer provider: spans are recorded from now on."""
    global _provider
    trace.set_tracer_provider(provider)
    _provider = provider


def enabled() -> bool:
    """Whether spans are recorded and sent (a provider is installed)."""
    return _provider is not None


def shutdown(timeout: float = SHUTDOWN_SECONDS) -> bool:
    """Send the spans still buffered and stop the exporter, for at most `timeout` seconds (no-op when tracing is
    off). A collector that accepts and never answers held the exporter (and so a SIGTERMed service) past its
    grace period; now what is not sent in time is dropped, and said. True when everything was sent."""
    global _provider
    if _provider is None:
        return True
    provider, _provider = _provider, None
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        log.warning("tracing: the collector did not take the last spans in time; they are dropped",
                    extra={"seconds": timeout})
        return False
    return True


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


class _MetadataGetter(Getter[Metadata]):
    """Reads keys from gRPC metadata: a sequence of (key, value) pairs, keys lower-case."""

    def get(self, carrier: Metadata, key: str) -> list[str] | None:
        values = [str(value) for k, value in carrier or () if k == key]
        return values or None

    def keys(self, carrier: Metadata) -> list[str]:
        return [k for k, _ in carrier or ()]


METADATA = _MetadataGetter()


def extract_metadata(metadata: Metadata | None) -> Context:
    """The trace context a gRPC caller sent (an empty context when it sent none)."""
    return PROPAGATOR.extract(metadata or (), getter=METADATA)


def extract(headers: Mapping[str, str]) -> Context:
    """The trace context an HTTP client sent (`traceparent`, `tracestate` headers)."""
    return PROPAGATOR.extract(headers)


def with_context(metadata: Iterable[tuple[str, str]], span: trace.Span) -> tuple[tuple[str, str], ...]:
    """`metadata` plus the `traceparent`/`tracestate` that make `span` the parent of the callee's spans.

    A span without a valid context (tracing off and no caller's context) adds nothing."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return (*metadata, *carrier.items())


def start_call(method: str, metadata: Metadata | None, request_id: str) -> trace.Span:
    """The span of an incoming gRPC call (`method`: "/package.Service/Method"), under the caller's context,
    made current for the rest of the call.

    Not detached again: grpc.aio runs every call in its own task, whose context ends with it (the
    request id context variable is set the same way). With tracing off: nothing, not even the caller's
    context is read."""
    if _provider is None:
        return trace.INVALID_SPAN
    name = method.lstrip("/")
    service, _, rpc = name.partition("/")
    span = tracer().start_span(name, context=extract_metadata(metadata), kind=trace.SpanKind.SERVER,
                               attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc,
                                           "grok.request_id": request_id})
    otel_context.attach(trace.set_span_in_context(span))
    return span


def end_call(span: trace.Span, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "") -> None:
    """End a call's span with the status the call ended with."""
    if span.is_recording():
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code.name}: {message}" if message else code.name))
    span.end()

