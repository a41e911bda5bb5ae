"""`python -m model_service`: parse flags (and GROK_MODEL_* variables), set up logging, JAX and serve."""

from __future__ import annotations

import argparse
import asyncio
import sys

from model_service.config import ConfigError, MeshConfig
from serving_common import logs
from serving_common.flags import EnvArgumentParser, port, positive_int


def bucket_list(raw: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{raw!r}: buckets must be positive integers, e.g. 32,64,128")
    return values


def mesh(raw: str) -> MeshConfig:
    try:
        return MeshConfig.parse(raw)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> EnvArgumentParser:
    p = EnvArgumentParser(env_prefix="GROK_MODEL", prog="python -m model_service",
                          description="Serve a Grok-1-architecture model over gRPC (grok.model.v1.ModelService) "
                                      "with continuous batching.")
    p.add_env_argument("--config", required=True, help="model preset (grok-1) or JSON config file")
    p.add_env_argument("--checkpoint", default=None, help="directory containing ckpt-0/ (released format)")
    p.add_env_argument("--random-init", action="store_true", default=False,
                       help="serve random weights when no --checkpoint is given (outputs are noise)")
    p.add_env_argument("--random-seed", type=int, default=0, help="seed of --random-init weights")
    p.add_env_argument("--host", default="0.0.0.0", help="address to bind")
    p.add_env_argument("--port", type=port, default=50053, help="gRPC port (0 picks a free one)")
    p.add_env_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_env_argument("--mesh", type=mesh, default="1,1", help="device mesh DATA,MODEL (e.g. 1,8)")
    p.add_env_argument("--slots", type=positive_int, default=8, help="batch slots decoded together")
    p.add_env_argument("--row-tile", type=positive_int, default=None,
                       help="decode rows computed together (default: 8 on CPU, all slots elsewhere); --slots must be "
                            "a multiple. A request's tokens depend on this and never on other requests: smaller tiles "
                            "cost less when few requests run, larger ones less when many do")
    p.add_env_argument("--prefill-chunk", type=int, default=64,
                       help="prompts longer than this are prefilled this many tokens at a time, with a decode step "
                            "for the running requests between chunks (0: whole prompts at once)")
    p.add_env_argument("--buckets", type=bucket_list, default=None,
                       help="prefill buckets, e.g. 32,64,128 (default: powers of two from 32 up to the context)")
    p.add_env_argument("--max-queue", type=positive_int, default=64, help="waiting-queue capacity")
    p.add_env_argument("--compile-cache", default=None, help="JAX persistent compilation cache directory")
    p.add_env_argument("--metrics-port", type=port, default=0, help="Prometheus /metrics port (0 = off)")
    p.add_env_argument("--grace-seconds", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_env_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="log level")
    return p


def configure_jax(compile_cache: str | None) -> None:
    import jax

    if compile_cache:
        jax.config.update("jax_compilation_cache_dir", compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure("model", args.log_level)
    configure_jax(args.compile_cache)
    from model_service.server import ServerConfig, serve

    config = ServerConfig(
        config=args.config, checkpoint=args.checkpoint, random_init=args.random_init, host=args.host,
        port=args.port, dtype=args.dtype, mesh=args.mesh, slots=args.slots, row_tile=args.row_tile,
        prefill_chunk=max(0, args.prefill_chunk),
        buckets=args.buckets,
        max_queue=args.max_queue, compile_cache=args.compile_cache, metrics_port=args.metrics_port,
        metrics_host=args.host, grace_seconds=args.grace_seconds, random_seed=args.random_seed)
    try:
        return asyncio.run(serve(config))
    except (ConfigError, ValueError) as e:
        print(f"model_service: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
