"""`python -m gateway.client "prompt" [--max-tokens N ...]`: stream a completion to the terminal.

The text is printed as it arrives; the finish reason, token counts and timings go to stderr. On an
error the gateway's status and message go to stderr and the exit code is 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

import grpc

from gateway.client import GatewayClient
from grok.gateway.v1 import gateway_pb2
from serving_common.flags import EnvArgumentParser, positive_int


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = EnvArgumentParser(env_prefix="GROK_CLIENT", prog="python -m gateway.client",
                               description="Stream a completion from the gateway.")
    parser.add_argument("prompt", help="the prompt text")
    parser.add_env_argument("--address", default="127.0.0.1:50051", help="gateway HOST:PORT, or unix:PATH (its --uds socket)")
    parser.add_argument("--max-tokens", type=positive_int, default=None, help="tokens to generate (server default)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most probable tokens (0/-1: off)")
    parser.add_argument("--min-p", type=float, default=None, help="min-p filter in [0, 1]")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="> 0; 1 is off")
    parser.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2]")
    parser.add_env_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--quiet", action="store_true", help="print only the text")
    parser.add_env_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY'")
    parser.add_env_argument("--tls-ca", default=None, help="PEM CA file: connect over TLS, verifying the gateway")
    return parser.parse_args(argv)


def stream(client: GatewayClient, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Print the text as it arrives; return the exit code."""
    last = gateway_pb2.GenerateResponse()
    try:
        for message in client.generate(
                args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, top_k=args.top_k, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, timeout=args.timeout):
            out.write(message.text)
            out.flush()
            last = message
    except grpc.RpcError as error:
        out.write("\n")
        err.write(f"error: {error.code().name}: {error.details()}\n")
        return 1
    out.write("\n")
    out.flush()
    if not args.quiet:
        reason = gateway_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        usage, timings = last.usage, last.timings
        err.write(f"[finish: {reason}; tokens: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion; "
                  f"first token {timings.time_to_first_token_seconds:.3f}s, total {timings.total_seconds:.3f}s]\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with GatewayClient(args.address, api_key=args.api_key, tls_ca=args.tls_ca) as client:
        return stream(client, args, sys.stdout, sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
