"""`python -m model_service`: parse flags (and GROK_MODEL_* variables), set up logging, JAX and serve.

With --num-processes N > 1 the process first joins its replica's group (jax.distributed); process 0 then
serves gRPC, every other process follows it (model_service/distributed) and has no gRPC API.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from model_service.config import (ATTENTION_CHOICES, BACKENDS, CPU_STEP_TOKENS, GENERIC_STEP_TOKENS, LAYERS_CHOICES,
                                  MOE_CHOICES, PRODUCT_CHOICES, ConfigError, MeshConfig)
from model_service.distributed import DistributedConfig
from model_service.pacing import DEFAULT_SLOWDOWN
from serving_common import logs, tracing
from serving_common.cpus import CpuBudget, cpu_budget
from serving_common.flags import EnvArgumentParser, add_uds_flag, port, positive_int
from serving_common.tls import add_server_flags, server_tls_from


def speculative_config(raw: str) -> object:
    from model_service.speculative import parse_speculative_config

    try:
        return parse_speculative_config(raw)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config: ")) from None


def bucket_list(raw: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{raw!r}: buckets must be positive integers, e.g. 32,64,128")
    return values


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def byte_size(raw: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    text = raw.strip().lower()
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):].strip()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a size: use bytes or a unit, e.g. 2GiB, 512MiB") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw!r}: the size must be positive")
    return int(value)


def mesh(raw: str) -> MeshConfig:
    try:
        return MeshConfig.parse(raw)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{raw} is not a duration: use 0 or more seconds")
    return value


def parser() -> EnvArgumentParser:
    p = EnvArgumentParser(env_prefix="GROK_MODEL", prog="python -m model_service",
                          description="Serve a Grok-1-architecture model over gRPC (grok.model.v1.ModelService) "
                                      "with continuous batching.")
    p.add_env_argument("--config", required=True, help="model preset (grok-1) or JSON config file")
    p.add_env_argument("--checkpoint", default=None, help="directory containing ckpt-0/ (released format)")
    p.add_env_argument("--random-init", action="store_true", default=False,
                       help="serve random weights when no --checkpoint is given (outputs are noise)")
    p.add_env_argument("--random-seed", type=int, default=0, help="seed of --random-init weights")
    p.add_env_argument("--tokenizer", default=None,
                       help="the model's SentencePiece file: enables structured output (JSON schema, regex, choice, "
                            "grammar constraints); without it constrained requests get INVALID_ARGUMENT")
    p.add_env_argument("--host", default="127.0.0.1",
                       help="address to bind, gRPC and metrics (0.0.0.0: every interface; no authentication)")
    p.add_env_argument("--port", type=port, default=50053, help="gRPC port (0 picks a free one)")
    add_uds_flag(p)
    p.add_env_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_env_argument("--mesh", type=mesh, default="1,1", help="device mesh DATA,MODEL (e.g. 1,8) or DATA,EXPERT,MODEL (e.g. 1,4,2: 4 expert groups, each holding num_experts/4 whole experts split over 2 model shards)")
    p.add_env_argument("--slots", type=positive_int, default=8,
                       help="the most sequences decoded at once (each sample of a request takes one)")
    p.add_env_argument("--kv-tokens", type=positive_int, default=None,
                       help="KV memory pool size in tokens, shared by all sequences in blocks (default: --slots full "
                            "contexts); more sequences than fit at full length may run, preempted when it fills")
    p.add_env_argument("--kv-memory", type=byte_size, default=None,
                       help="KV memory pool size in bytes instead of tokens, e.g. 4GiB (keys and values of every "
                            "layer, in the compute dtype)")
    p.add_env_argument("--block-size", type=positive_int, default=16,
                       help="tokens per KV memory block (a power of two up to 128)")
    p.add_env_argument("--prefix-caching", choices=("on", "off"), default="on",
                       help="reuse the KV blocks of prompt prefixes computed before (shared system prompts, "
                            "few-shot headers, multi-turn chats); outputs are the same either way")
    p.add_env_argument("--huge-pages", choices=("on", "off"), default="on",
                       help="once loaded and compiled, back the weights and the step's buffers with transparent huge "
                            "pages (Linux; fewer page-table walks for the bytes each token reads)")
    p.add_env_argument("--threads", type=positive_int, default=None,
                       help="compute threads (XLA's CPU pool, which the native kernels share; default: the CPUs this "
                            "process may keep busy, i.e. its CPU affinity capped by a cgroup CPU limit such as "
                            "docker --cpus or a Kubernetes limits.cpu)")
    p.add_env_argument("--max-num-batched-tokens", type=positive_int, default=None,
                       help=f"token rows per step, prompt and decode rows together (default: {CPU_STEP_TOKENS} on "
                            f"CPU, {GENERIC_STEP_TOKENS} elsewhere; at least --slots). Prompts of any length up to "
                            "the context are computed over as many steps as they need")
    p.add_env_argument("--prefill-tokens", type=positive_int, default=None,
                       help="fixes the prompt tokens a step takes while other requests decode (default: sized "
                            "from measured step times, see --decode-slowdown); with nothing decoding a step is all "
                            "prompt")
    p.add_env_argument("--decode-slowdown", type=slowdown_factor, default=DEFAULT_SLOWDOWN,
                       help="while prompts are computed beside running streams, a step takes at most this many "
                            "times a decode-only step: larger gets long prompts to their first token sooner, "
                            "smaller keeps running streams smoother")
    p.add_env_argument("--speculative-config", type=speculative_config, default=None,
                       help="speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": "
                            "4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}: drafts looked up in each "
                            "request's own prompt and output, verified in one step; every token is the one decoding "
                            "without it draws (off by default)")
    p.add_env_argument("--tile-rows", type=positive_int, default=None,
                       help="rows computed together in one pass over the weights (default: 64 on CPU, the whole "
                            "step elsewhere). A request's tokens depend on this and never on other requests")
    p.add_env_argument("--backend", choices=BACKENDS, default="auto",
                       help="the hardware choices: cpu (native products, per-row attention, small tiles), generic "
                            "(XLA's dot products, batched attention, one tile per step: what a GPU or TPU runs) or "
                            "auto (cpu on a CPU, generic elsewhere)")
    p.add_env_argument("--moe", choices=MOE_CHOICES, default="auto",
                       help="how the generic backend runs the experts: pallas (the grouped int8 kernel, one TPU "
                            "device), ragged (XLA's ragged_dot over expert-sorted rows, the experts widened), cond (a "
                            "conditional per expert) or auto (pallas on one TPU in bfloat16, cond there in float32, "
                            "the faithful mode, whose golden parity the kernel failed on the chip; ragged on other "
                            "single devices, cond on meshes and on the cpu backend)")
    p.add_env_argument("--attention", choices=ATTENTION_CHOICES, default="auto",
                       help="how the generic backend attends: batched (XLA: a step's decode rows read keys up to the "
                            "step's longest sequence), pallas (one TPU device: decode rows read their own KV blocks "
                            "only, through a Pallas kernel; prompt chunks as batched) or auto (pallas on one TPU "
                            "device in bfloat16 with a --block-size the kernel tiles, 16 or a multiple, query heads a "
                            "multiple of 16 and KV heads x head size of 128; batched elsewhere, float32 included)")
    p.add_env_argument("--layers", choices=LAYERS_CHOICES, default="auto",
                       help="how the generic backend runs the decoder layers: scan (one loop over parameters and KV "
                            "pools stacked along a layer axis: each step program is the same size at any depth, so "
                            "its compile time does not grow with it), unroll (one copy of a layer per layer in each "
                            "program: compile time grows with the depth) or auto (the generic backend scans, except on an "
                            "accelerator mesh with an expert axis; the cpu backend always unrolls)")
    p.add_env_argument("--products", choices=PRODUCT_CHOICES, default="auto",
                       help="how token rows meet the weights: native (the int8 CPU kernel built with the package: "
                            "float32 on CPU only), native-int8 (native with each row rounded to int8 per 32 values "
                            "before it meets an int8 weight, as llama.cpp's Q8_0 does: on CPUs with AVX-512 VNNI 2-3x "
                            "faster prompts and batches, elsewhere slower than native; results change slightly; "
                            "opt-in), xla (XLA's own products), int8 (the generic backend: each row rounded to int8 "
                            "per row block before it meets an int8 weight, int8 x int8 on the matrix unit, twice a "
                            "TPU v5e's bfloat16 rate; changes results; opt-in) or auto (native where it can run, "
                            "else xla; GPUs/TPUs use XLA's)")
    p.add_env_argument("--buckets", type=bucket_list, default=None,
                       help="no longer used (prompts up to the context are accepted with any settings); accepted "
                            "so that existing deployments start, with a warning")
    p.add_env_argument("--max-queue", type=positive_int, default=64, help="waiting-queue capacity")
    p.add_env_argument("--compile-cache", default=None,
                       help="JAX persistent compilation cache directory; replicas sharing it that start together "
                            "compile once (the others wait, then read the programs)")
    p.add_env_argument("--metrics-port", type=port, default=0, help="Prometheus /metrics port (0 = off)")
    add_uds_flag(p, "--metrics-uds", "serve Prometheus /metrics on this unix socket file instead of --metrics-port "
                 "(the gateway scrapes it as --model-metrics unix:PATH); owner-only, removed at exit")
    p.add_env_argument("--grace-seconds", type=float, default=10.0, help="drain time on SIGTERM")
    p.add_env_argument("--engine-process", nargs="?", const="on", default="auto", type=engine_process_choice,
                       help="auto|on|off: run the engine and its decode loop in a child process of their own, so "
                            "that the gRPC event loop never takes the interpreter lock from the loop that feeds the "
                            "device; auto (default): on where an accelerator is expected (a TPU or GPU: JAX_PLATFORMS, "
                            "or its device files) and the replica is one process, off on CPU; the flag alone means on "
                            "(docs/running.md, \"The engine in its own process\")")
    p.add_env_argument("--watchdog-seconds", type=float, default=60.0,
                       help="report NOT_SERVING and fail pending requests with UNAVAILABLE when no decode step "
                            "advances for this long while work is pending (0 disables)")
    p.add_env_argument("--max-connection-age-seconds", type=seconds, default=30.0,
                       help="send each client connection a GOAWAY after about this long (calls in flight go on): "
                            "clients reconnect and re-resolve dns:/// names, so replicas added later get "
                            "traffic (0 = keep connections forever)")
    p.add_env_argument("--max-connection-age-grace-seconds", type=seconds, default=None,
                       help="how long calls in flight may go on after that GOAWAY (default: no limit)")
    p.add_env_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="log level")
    logs.add_flag(p)
    add_server_flags(p)
    tracing.add_flag(p)
    p.add_env_argument("--coordinator", default=None,
                       help="HOST:PORT of process 0's coordination service; process 0 binds exactly this address, "
                            "the others connect to it")
    p.add_env_argument("--num-processes", type=positive_int, default=1,
                       help="processes in this replica's group (1: a single-process replica)")
    p.add_env_argument("--process-id", type=int, default=0,
                       help="this process's index: 0 serves gRPC and drives the steps, the others follow it")
    p.add_env_argument("--between-hosts", type=mesh, default=None,
                       help="DATA,MODEL: how the processes tile --mesh, each holding a DATA/d x MODEL/m block "
                            "(default: over the data axis when the process count divides it, else the model axis)")
    p.add_env_argument("--step-timeout", type=positive_float, default=60.0,
                       help="seconds one engine step may take on the group before it counts as broken")
    p.add_env_argument("--startup-timeout", type=positive_float, default=3600.0,
                       help="seconds every process of the group may take to load its weights and compile")
    return p


def number_above(raw: str, bound: float, unit: str = "") -> float:
    """A flag's number, refused unless it is over `bound`."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not value > bound:
        raise argparse.ArgumentTypeError(f"{raw} must be > {bound:g}{unit}")
    return value


def positive_float(raw: str) -> float:
    return number_above(raw, 0, " seconds")


def slowdown_factor(raw: str) -> float:
    return number_above(raw, 1, " (a mixed step cannot take less than a decode step)")


ENGINE_PROCESS_CHOICES = ("auto", "on", "off")


def engine_process_choice(raw: str) -> str:
    """--engine-process's value: auto, on or off (1/true/yes and 0/false/no, as the environment writes them)."""
    value = raw.strip().lower()
    value = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(value, value)
    if value not in ENGINE_PROCESS_CHOICES:
        raise argparse.ArgumentTypeError(f"{raw!r} is not one of auto, on, off")
    return value


def engine_process_on(choice: str, distributed: DistributedConfig | None) -> bool:
    """Whether the engine runs in a child process: `on`; `auto` where an accelerator is expected (told without
    starting JAX) and the replica is one process (on a TPU v5e at 64 streams the model service alone made 0.43-0.45x
    the in-process engine's tokens/s with it, 0.31-0.39x without; on a 2-core CPU it bought nothing)."""
    from model_service.host_memory import accelerator_expected

    if choice == "auto":
        return distributed is None and accelerator_expected() is not None
    return choice == "on"


def distributed_config(args: argparse.Namespace) -> DistributedConfig | None:
    """None for a single-process replica; raises ConfigError for an inconsistent group setting."""
    if args.num_processes == 1:
        if args.coordinator or args.process_id:
            raise ConfigError("--coordinator/--process-id need --num-processes >= 2")
        return None
    if not args.coordinator:
        raise ConfigError("--num-processes > 1 needs --coordinator HOST:PORT (process 0's address)")
    if getattr(args, "engine_process", "auto") == "on":
        raise ConfigError("--engine-process runs one process's engine in a child process; a replica of "
                          "--num-processes > 1 keeps its engine in process 0 (the two are not supported together): "
                          "leave --engine-process off")
    config = DistributedConfig(coordinator=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, between_hosts=args.between_hosts,
                               step_timeout=args.step_timeout, startup_timeout=args.startup_timeout)
    config.validate()
    return config


def prepare_process(threads: int | None = None) -> CpuBudget:
    """Process-wide settings a model process needs before JAX computes anything: the host allocator keeps
    the decode step's freed buffers (model_service/host_memory.py), and XLA's CPU thread pool, which the native
    kernels share, gets `threads` threads, by default the CPUs this process may keep busy (its affinity capped by
    a cgroup CPU limit: serving_common/cpus.py). XLA sizes that pool from NPROC when it is set, so an NPROC
    already in the environment is kept unless `threads` is given; raises ConfigError when it is not a whole number
    >= 1. Returns the budget it found. Where JAX will compute on an accelerator (host_memory.accelerator_expected)
    the allocator is left as it is: its one arena would serialise the accelerator compiler's threads."""
    from model_service.host_memory import accelerator_expected, keep_freed_memory

    accelerator = accelerator_expected()
    if accelerator:
        logging.getLogger(__name__).info(f"host allocator left as configured: JAX computes on {accelerator}")
    else:
        keep_freed_memory()
    budget = cpu_budget()
    if threads is not None:
        os.environ["NPROC"] = str(threads)
    else:
        os.environ.setdefault("NPROC", str(budget.threads))
    try:
        valid = int(os.environ["NPROC"]) >= 1
    except ValueError:
        valid = False
    if not valid:
        raise ConfigError(f"NPROC={os.environ['NPROC']!r} is not a number of compute threads (a whole number >= 1): "
                          "set one, or unset it for the CPUs this process may use")
    return budget


def configure_jax(compile_cache: str | None) -> None:
    import jax

    if compile_cache:
        jax.config.update("jax_compilation_cache_dir", compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    tls = server_tls_from(p, args)
    logs.configure("model", args.log_level, args.log_format)
    try:
        dist = distributed_config(args)
    except ConfigError as e:
        print(f"model_service: {e}", file=sys.stderr)
        return 2
    compile_cache = args.compile_cache
    if dist is not None and compile_cache:
        # A group compiles each program once, on process 0, and sends it to the others (distributed/config.py,
        # compile_once). A persistent cache cannot join that: JAX writes entries from process 0 only, so on a
        # restart process 0 would load a program the others wait for in vain.
        logging.getLogger(__name__).warning("--compile-cache is not used by a multi-process replica")
        compile_cache = None
    try:
        budget = prepare_process(args.threads)
    except ConfigError as e:
        print(f"model_service: {e} (or pass --threads N)", file=sys.stderr)
        return 2
    threads = int(os.environ["NPROC"])
    logging.getLogger(__name__).info("cpus", extra={"threads": threads, "affinity": budget.affinity,
                                                    "cgroup_limit": budget.quota})
    if threads > budget.threads:
        logging.getLogger(__name__).warning(
            f"{threads} compute threads for {budget.threads} usable CPUs (affinity {budget.affinity}, cgroup limit "
            f"{budget.quota}): the threads will wait for each other; leave --threads and NPROC unset to match")
    configure_jax(compile_cache)
    if args.buckets is not None:
        logging.getLogger(__name__).warning("--buckets (GROK_MODEL_BUCKETS) is no longer used and is ignored: "
                                            "prompts up to the context are accepted")
    # With --engine-process the child starts JAX and checks the devices: not this one (one process only).
    engine_child = engine_process_on(args.engine_process, dist)
    if dist is not None:
        from model_service.distributed import initialize

        initialize(dist)  # before anything creates a JAX backend
    from model_service.loading import ServerConfig
    from model_service.server import serve

    config = ServerConfig(
        config=args.config, checkpoint=args.checkpoint, random_init=args.random_init, host=args.host,
        port=args.port, uds=args.uds, dtype=args.dtype, mesh=args.mesh, slots=args.slots, backend=args.backend,
        moe=args.moe, layers=args.layers, attention=args.attention, products=args.products, kv_tokens=args.kv_tokens,
        kv_memory=args.kv_memory,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching == "on", huge_pages=args.huge_pages == "on",
        step_tokens=args.max_num_batched_tokens, prefill_tokens=args.prefill_tokens,
        decode_slowdown=args.decode_slowdown, tile_rows=args.tile_rows,
        speculative=args.speculative_config,
        max_queue=args.max_queue, metrics_port=args.metrics_port, metrics_uds=args.metrics_uds,
        metrics_host=args.host, grace_seconds=args.grace_seconds, random_seed=args.random_seed, tls=tls,
        max_connection_age_seconds=args.max_connection_age_seconds,
        max_connection_age_grace_seconds=args.max_connection_age_grace_seconds, distributed=dist,
        watchdog_seconds=args.watchdog_seconds, tokenizer=args.tokenizer, engine_process=engine_child)
    try:
        from model_service.placement import check_service

        if not engine_child:
            check_service(config)  # refuse a layout that does not fit, with the numbers, before loading anything
        if dist is not None and not dist.is_leader:
            from model_service.distributed.group import run_follower

            code = run_follower(config)
        else:
            tracing.configure("model", args.otlp_endpoint)  # only process 0 serves calls
            code = asyncio.run(serve(config))
    except (ConfigError, ValueError, OSError) as e:  # OSError: a port in use or not on this machine
        print(f"model_service: {e}", file=sys.stderr)
        code = 2
    finally:
        tracing.shutdown()  # the last requests' spans
    if dist is not None and code != 0:
        from model_service.distributed.follower import exit_now

        exit_now(code)  # skip jax.distributed's exit barrier: a peer is gone or never agreed
    return code


if __name__ == "__main__":
    sys.exit(main())
