"""`python -m tokenizer_service --model PATH --host H --port P ...`: run the tokenizer gRPC service.

Every flag also reads GROK_TOKENIZER_<FLAG> from the environment (the flag wins).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from serving_common import logs, tracing
from serving_common.flags import EnvArgumentParser, add_uds_flag, port, positive_int
from serving_common.tls import add_server_flags, server_tls_from
from tokenizer_service.server import DEFAULT_PORT, TokenizerConfig, serve


def _non_negative_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{raw} is negative: use 0 or more seconds")
    return value


def build_parser() -> EnvArgumentParser:
    """Every tokenizer-service flag (scripts/run_stack.py passes them through by these names)."""
    parser = EnvArgumentParser(env_prefix="GROK_TOKENIZER", prog="python -m tokenizer_service",
                               description="gRPC tokenizer service (SentencePiece encode/decode, streaming detokenizer).")
    parser.add_env_argument("--model", required=True, help="path of the SentencePiece .model file")
    parser.add_env_argument("--host", default="127.0.0.1",
                            help="address to listen on (0.0.0.0: every interface; the service has no authentication)")
    parser.add_env_argument("--port", type=port, default=DEFAULT_PORT, help="TCP port (0 picks a free one)")
    add_uds_flag(parser)
    parser.add_env_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                            help="JSON log level")
    parser.add_env_argument("--grace-seconds", type=_non_negative_float, default=10.0,
                            help="on SIGTERM, how long in-flight calls may finish")
    parser.add_env_argument("--max-text-bytes", type=positive_int, default=1 << 20,
                            help="largest text (UTF-8 bytes) Encode/EncodeBatch accept per text")
    parser.add_env_argument("--max-batch", type=positive_int, default=256, help="most texts per EncodeBatch")
    parser.add_env_argument("--max-tokens", type=positive_int, default=1 << 20,
                            help="most ids per Decode call or DecodeStream message")
    logs.add_flag(parser)
    add_server_flags(parser)
    tracing.add_flag(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> TokenizerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    tls = server_tls_from(parser, args)
    return TokenizerConfig(tls=tls, model_path=args.model, host=args.host, port=args.port, uds=args.uds,
                           grace_seconds=args.grace_seconds, max_text_bytes=args.max_text_bytes,
                           max_batch=args.max_batch, max_tokens=args.max_tokens, log_level=args.log_level, log_format=args.log_format,
                           otlp_endpoint=args.otlp_endpoint)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logs.configure("tokenizer", config.log_level, config.log_format)
    tracing.configure("tokenizer", config.otlp_endpoint)
    try:
        asyncio.run(serve(config))
    except (OSError, ValueError) as err:
        logging.getLogger("tokenizer_service").error("startup failed", extra={"error": str(err)})
        return 2
    finally:
        tracing.shutdown()  # the last calls' spans
    return 0


if __name__ == "__main__":
    sys.exit(main())
