"""`python -m gateway --tokenizer ADDR --model ADDR[,ADDR...]`: run the gateway (flags or GROK_GATEWAY_* env)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from gateway.config import GatewayConfig, Limits
from gateway.server import serve
from serving_common import logs
from serving_common.flags import EnvArgumentParser, port, positive_int


def split_models(value: str) -> tuple[str, ...]:
    """Comma-separated replica addresses; an `ipv4:`/`ipv6:` target is one channel over all its addresses."""
    value = value.strip()
    if value.startswith(("ipv4:", "ipv6:")):
        return (value,)
    return tuple(m.strip() for m in value.split(",") if m.strip())


def parse_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    parser = EnvArgumentParser(env_prefix="GROK_GATEWAY", prog="python -m gateway",
                               description="The public text API in front of the tokenizer and model services.")
    parser.add_env_argument("--tokenizer", required=True, help="tokenizer service HOST:PORT")
    parser.add_env_argument("--model", required=True,
                            help="model service HOST:PORT, or several comma-separated replicas; a DNS name "
                                 "resolving to several addresses, or an ipv4:A:P,B:P target, is balanced "
                                 "round-robin by gRPC")
    parser.add_env_argument("--host", default="127.0.0.1",
                            help="address to listen on (0.0.0.0: every interface; the service has no authentication)")
    parser.add_env_argument("--port", type=port, default=50051, help="gRPC port (0 picks a free one)")
    parser.add_env_argument("--metrics-port", type=port, default=0, help="Prometheus /metrics port (0 disables)")
    parser.add_env_argument("--default-max-tokens", type=positive_int, default=64,
                            help="max_tokens of requests that leave it unset")
    parser.add_env_argument("--max-prompt-bytes", type=positive_int, default=65536, help="longest prompt in bytes")
    parser.add_env_argument("--max-stop", type=int, default=8, help="most stop sequences per request")
    parser.add_env_argument("--max-stop-chars", type=positive_int, default=256, help="longest stop sequence")
    parser.add_env_argument("--grace-seconds", type=float, default=10.0,
                            help="on SIGTERM, how long in-flight requests may finish")
    parser.add_env_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    models = split_models(str(args.model))
    limits = Limits(max_prompt_bytes=args.max_prompt_bytes, max_stop=args.max_stop,
                    max_stop_chars=args.max_stop_chars, default_max_tokens=args.default_max_tokens)
    try:
        return GatewayConfig(tokenizer=args.tokenizer, models=models, host=args.host, port=args.port,
                             metrics_port=args.metrics_port, grace_seconds=args.grace_seconds,
                             log_level=args.log_level, limits=limits)
    except ValueError as error:
        parser.error(str(error))
        raise


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    logs.configure("gateway", config.log_level)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
