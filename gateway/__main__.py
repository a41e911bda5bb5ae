"""`python -m gateway --tokenizer ADDR --model ADDR[,ADDR...]`: run the gateway (flags or GROK_GATEWAY_* env)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from gateway.auth import load_keys
from gateway.config import DETOKENIZE_MODES, GatewayConfig, HttpConfig, Limits
from gateway.server import serve
from serving_common import logs, tracing
from serving_common.flags import EnvArgumentParser, add_uds_flag, port, positive_int
from serving_common.tls import ChannelTLS, server_tls


def split_models(value: str) -> tuple[str, ...]:
    """Comma-separated replica addresses; an `ipv4:`/`ipv6:` target is one channel over all its addresses."""
    value = value.strip()
    if value.startswith(("ipv4:", "ipv6:")):
        return (value,)
    return tuple(m.strip() for m in value.split(",") if m.strip())


def metrics_urls(value: str) -> tuple[str, ...]:
    """--model-metrics: comma-separated http(s) URLs, or unix:PATH (a model service's --metrics-uds)."""
    urls = tuple(u.strip() for u in value.split(",") if u.strip())
    for url in urls:
        if not url.startswith(("http://", "https://", "unix:")):
            raise ValueError(f"--model-metrics: {url!r} is not an http:// URL (e.g. http://127.0.0.1:9091/metrics) "
                             "or unix:PATH")
    return urls


def non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{raw} is negative: use 0 or more")
    return value


def add_http_flags(parser: EnvArgumentParser) -> None:
    parser.add_env_argument("--http-port", type=port, default=8000,
                            help="OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, "
                                 "/v1/models, /health); 0 disables it")
    add_uds_flag(parser, "--http-uds", "serve the HTTP API on this unix socket file instead of --http-port "
                 "(curl --unix-socket PATH); created owner-only (0600), removed at exit; an existing file is refused")
    parser.add_env_argument("--served-model-name", default="grok-1",
                            help="model id of the HTTP API (/v1/models; requests naming another model get 404)")
    parser.add_env_argument("--chat-template", default=None,
                            help="Jinja2 chat template file for /v1/chat/completions "
                                 "(default: gateway/templates/chat_default.jinja)")
    parser.add_env_argument("--http-timeout", type=float, default=600.0,
                            help="seconds an HTTP request may take before it ends with 504 (0: no limit)")


def add_security_flags(parser: EnvArgumentParser) -> None:
    parser.add_env_argument("--api-key", default=None,
                            help="require 'authorization: Bearer KEY' on gRPC and HTTP (comma-separated keys); "
                                 "health and metrics stay open")
    parser.add_env_argument("--api-key-file", default=None, help="file of accepted API keys, one per line")
    parser.add_env_argument("--tls-cert", default=None, help="PEM certificate chain: TLS on the gRPC and HTTP ports")
    parser.add_env_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_env_argument("--tls-ca", default=None,
                            help="PEM CA certificate of the tokenizer and model services: talk to them over TLS")
    parser.add_env_argument("--tls-client-cert", default=None,
                            help="PEM certificate the gateway presents to the services (mutual TLS; needs --tls-ca)")
    parser.add_env_argument("--tls-client-key", default=None, help="PEM private key of --tls-client-cert")
    parser.add_env_argument("--tls-server-name", default=None,
                            help="name to check in the services' certificates instead of the host in the address")


def backend_tls(args: argparse.Namespace) -> ChannelTLS | None:
    if not args.tls_ca:
        if args.tls_client_cert or args.tls_client_key or args.tls_server_name:
            raise ValueError("--tls-client-cert/--tls-client-key/--tls-server-name need --tls-ca "
                             "(the CA that signed the services' certificates)")
        return None
    tls = ChannelTLS(args.tls_ca, args.tls_client_cert, args.tls_client_key, args.tls_server_name)
    tls.grpc_credentials()  # fail at start-up, naming the flag, if a file is unreadable
    return tls


def build_parser() -> EnvArgumentParser:
    """Every gateway flag (scripts/run_stack.py passes them through by these names)."""
    parser = EnvArgumentParser(env_prefix="GROK_GATEWAY", prog="python -m gateway",
                               description="The public text API in front of the tokenizer and model services.")
    parser.add_env_argument("--tokenizer", required=True, help="tokenizer service HOST:PORT or unix:PATH")
    parser.add_env_argument("--model", required=True,
                            help="model service HOST:PORT or unix:PATH, or several comma-separated replicas; a DNS "
                                 "name resolving to several addresses, or an ipv4:A:P,B:P target, is balanced "
                                 "round-robin by gRPC")
    parser.add_env_argument("--host", default="127.0.0.1",
                            help="address to listen on, gRPC, HTTP and metrics (0.0.0.0: every interface)")
    parser.add_env_argument("--port", type=port, default=50051, help="gRPC port (0 picks a free one)")
    add_uds_flag(parser)
    parser.add_env_argument("--metrics-port", type=port, default=0, help="Prometheus /metrics port (0 disables)")
    parser.add_env_argument("--model-metrics", default="",
                            help="the model replicas' Prometheus URLs, comma-separated (http://HOST:PORT/metrics, "
                                 "or unix:PATH for a replica's --metrics-uds; "
                                 "a name resolving to several addresses is scraped at each): their series join the "
                                 "gateway's /metrics, on --metrics-port and the HTTP API (docs/metrics.md)")
    defaults = Limits()  # each limit's default is declared once, in gateway/config.py
    parser.add_env_argument("--default-max-tokens", type=positive_int, default=defaults.default_max_tokens,
                            help="max_tokens of requests that leave it unset")
    parser.add_env_argument("--max-prompt-bytes", type=positive_int, default=defaults.max_prompt_bytes,
                            help="longest text prompt in bytes (default: 16 per token of the model's context)")
    parser.add_env_argument("--max-stop", type=int, default=defaults.max_stop, help="most stop sequences per request")
    parser.add_env_argument("--max-stop-chars", type=positive_int, default=defaults.max_stop_chars,
                            help="longest stop sequence")
    parser.add_env_argument("--max-top-logprobs", type=int, default=defaults.max_top_logprobs,
                            help=f"most alternatives per token a request may ask for (top_logprobs / logprobs), "
                                 f"0..{defaults.max_top_logprobs}, the most the model computes")
    parser.add_env_argument("--grace-seconds", type=float, default=10.0,
                            help="on SIGTERM, how long in-flight requests may finish")
    parser.add_env_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    logs.add_flag(parser)
    parser.add_env_argument("--detokenize", default="local", choices=list(DETOKENIZE_MODES),
                            help="where generated ids become text: 'local', the tokenizer service's incremental "
                                 "detokenizer run in the gateway over the piece table it fetches from that service "
                                 "(no message per token; see docs/benchmarks.md), or 'remote', a DecodeStream call "
                                 "to the tokenizer service per request")
    parser.add_env_argument("--model-streams", type=non_negative_int, default=1,
                            help="GenerateMany streams to each model replica, shared by its requests: a decode step's "
                                 "tokens for all of them in one message (0: one Generate call per request, the "
                                 "older protocol; a replica without GenerateMany gets that anyway)")
    parser.add_env_argument("--stream-interval", type=positive_int, default=1,
                            help="send each completion's tokens to its client N at a time, the first token and the "
                                 "last message at once (vLLM's --stream-interval): fewer messages per token for the "
                                 "gateway and its clients, each message later by up to N-1 decode steps")
    parser.add_env_argument("--model-retry-seconds", type=float, default=30.0,
                            help="how long a request that no model replica has started (nothing sent to its client) "
                                 "is retried while every replica is unavailable, e.g. the only one restarting; never "
                                 "past the request's deadline; 0: UNAVAILABLE at once")
    add_http_flags(parser)
    add_security_flags(parser)
    tracing.add_flag(parser)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    models = split_models(str(args.model))
    http = HttpConfig(port=args.http_port, uds=args.http_uds, model_name=args.served_model_name, chat_template=args.chat_template,
                      timeout_seconds=args.http_timeout)
    try:
        limits = Limits(max_prompt_bytes=args.max_prompt_bytes, max_stop=args.max_stop,
                        max_stop_chars=args.max_stop_chars, default_max_tokens=args.default_max_tokens,
                        max_top_logprobs=args.max_top_logprobs)
        if args.http_timeout < 0:
            raise ValueError("--http-timeout: must be >= 0 seconds (0: no limit)")
        return GatewayConfig(tokenizer=args.tokenizer, models=models, host=args.host, port=args.port, uds=args.uds,
                             metrics_port=args.metrics_port, model_metrics=metrics_urls(args.model_metrics),
                             grace_seconds=args.grace_seconds,
                             log_level=args.log_level, log_format=args.log_format, limits=limits, http=http,
                             detokenize=args.detokenize,
                             api_keys=load_keys(args.api_key, args.api_key_file),
                             tls=server_tls(args.tls_cert, args.tls_key), backend_tls=backend_tls(args),
                             otlp_endpoint=args.otlp_endpoint, model_streams=args.model_streams, stream_interval=args.stream_interval,
                             model_retry_seconds=max(0.0, args.model_retry_seconds))
    except ValueError as error:
        parser.error(str(error))
        raise


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logs.configure("gateway", config.log_level, config.log_format)
    tracing.configure("gateway", config.otlp_endpoint)
    try:
        asyncio.run(serve(config))
    except OSError as error:  # a port in use or not on this machine: one line, no traceback
        logging.getLogger("gateway").error("startup failed", extra={"error": str(error)})
        return 2
    finally:
        tracing.shutdown()  # the last requests' spans
    return 0


if __name__ == "__main__":
    sys.exit(main())
