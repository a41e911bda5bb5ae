"""The gateway's configuration: one frozen dataclass, parsed once from flags and environment in __main__."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving_common.limits import MAX_TOP_LOGPROBS
from serving_common.tls import ChannelTLS, ServerTLS


DETOKENIZE_MODES = ("remote", "local")
# The default prompt byte limit per token of the model's context: English takes ~4 bytes a token with Grok-1's
# tokenizer and ~8 with the demo's 1,024 pieces, so any such prompt the context holds is accepted for its bytes.
PROMPT_BYTES_PER_TOKEN = 16


@dataclass(frozen=True)
class Limits:
    """Request limits enforced at the boundary and their defaults, declared here only: each is a flag of
    gateway/__main__.py (its default taken from here). The bounds the model service enforces as well are in
    serving_common/limits.py."""

    max_prompt_bytes: int = 0  # --max-prompt-bytes; 0: PROMPT_BYTES_PER_TOKEN per token of the model's context
    max_stop: int = 8  # --max-stop: stop sequences per request
    max_stop_chars: int = 256  # --max-stop-chars
    default_max_tokens: int = 64  # --default-max-tokens: max_tokens when a request leaves it unset
    max_top_logprobs: int = MAX_TOP_LOGPROBS  # --max-top-logprobs: may lower, never raise, the device's 20

    def __post_init__(self) -> None:
        if not 0 <= self.max_top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"--max-top-logprobs: must be in 0..{MAX_TOP_LOGPROBS} (the alternatives the model "
                             f"computes per token), got {self.max_top_logprobs}")


def prompt_byte_limit(limits: Limits, context: int) -> int:
    """The longest text prompt in bytes: --max-prompt-bytes, else derived from the model's context."""
    return limits.max_prompt_bytes or context * PROMPT_BYTES_PER_TOKEN


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP API (gateway/http/)."""

    port: int = 8000  # 0: no HTTP API
    uds: str | None = None  # listen on this unix socket file instead of the TCP port
    model_name: str = "grok-1"  # the id /v1/models lists and requests may name
    chat_template: str | None = None  # Jinja2 file; None: gateway/templates/chat_default.jinja
    timeout_seconds: float = 600.0  # server-side deadline of an HTTP request; 0: none


@dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway listens and which backends it talks to."""

    tokenizer: str
    models: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 50051
    uds: str | None = None  # the gRPC API on this unix socket file instead of host:port
    metrics_port: int = 0
    # The model replicas' /metrics URLs: their series join the gateway's /metrics (gateway/replica_metrics.py).
    model_metrics: tuple[str, ...] = ()
    grace_seconds: float = 10.0
    log_level: str = "info"
    log_format: str = "auto"  # serving_common.logs: text on a terminal, else JSON
    limits: Limits = Limits()
    http: HttpConfig = HttpConfig()
    # Keys callers must present (`authorization: Bearer KEY`); empty: no authentication. Never logged.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    tls: ServerTLS | None = None  # TLS on the public gRPC and HTTP ports
    backend_tls: ChannelTLS | None = None  # TLS (mTLS with a client certificate) to the tokenizer and models
    # How long a health watch waits before reconnecting to a dependency that went away.
    health_retry_seconds: float = 0.5
    # Tokenizer calls are retried on UNAVAILABLE this many times (cheap, idempotent calls).
    tokenizer_retries: int = 2
    # Where generated ids become text: "local" (the tokenizer service's detokenizer run in the gateway, over the
    # piece table fetched from that service: no message per token) or "remote" (its DecodeStream, per request).
    detokenize: str = "local"
    otlp_endpoint: str | None = None  # OTLP/gRPC collector for traces (serving_common.tracing); None: off
    # GenerateMany streams to each model replica that its requests share (0: a Generate call per request).
    model_streams: int = 1
    # How long a request that no model replica has started keeps being retried while every replica is
    # unavailable (one dying or restarting), within its deadline; 0: it fails at once with UNAVAILABLE.
    model_retry_seconds: float = 30.0
    # A completion's tokens are sent to its client this many at a time (its first and last message at once):
    # fewer messages, writes and wake-ups per token in the gateway and the client (vLLM's --stream-interval).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if not self.tokenizer:
            raise ValueError("--tokenizer: the tokenizer service address is required (HOST:PORT or unix:PATH)")
        if self.detokenize not in DETOKENIZE_MODES:
            raise ValueError(f"--detokenize: {self.detokenize!r} is not one of {', '.join(DETOKENIZE_MODES)}")
        if not self.models or any(not m for m in self.models):
            raise ValueError("--model: at least one model service address is required (HOST:PORT or unix:PATH, "
                             "comma-separated for several)")
