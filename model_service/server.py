"""The model service process: gRPC server first (NOT_SERVING), then load + compile, then SERVING.

`build_server` binds the port and registers ModelService, health and reflection; `ModelServer.load`
loads the weights, builds and compiles the Engine (every prefill bucket and the decode step) off the
event loop, starts the Scheduler and only then flips health to SERVING. SIGTERM drains: health
NOT_SERVING, no new requests, in-flight streams get the grace period, then the decode thread stops.

In a multi-process replica (`ServerConfig.distributed`) this is process 0: its engine is a LockstepEngine
(model_service/distributed). When the group breaks, health turns NOT_SERVING, in-flight streams end with
UNAVAILABLE and `serve` returns EXIT_GROUP_BROKEN, so that the orchestrator restarts the group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.config import MeshConfig, ModelConfig, load_model_config, validate
from model_service.distributed import EXIT_GROUP_BROKEN, DistributedConfig
from model_service.distributed.lockstep import GroupBroken
from model_service.engine import Engine
from model_service.metrics import Metrics
from model_service.scheduler import Scheduler
from model_service.servicer import ModelServicer
from model_service.watchdog import Watchdog
from serving_common.grpc_server import (
    HealthReporter, add_health_and_reflection, connection_age_options, new_server, serve_until_signal)
from serving_common.tls import ServerTLS, bind_port

log = logging.getLogger(__name__)

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name
BROKEN_LINGER_SECONDS = 2.0  # NOT_SERVING and the failed streams' statuses go out before a broken group exits


@dataclass(frozen=True)
class ServerConfig:
    """Everything `python -m model_service` is configured with (parsed once in __main__)."""

    config: str
    checkpoint: str | None
    random_init: bool = False
    host: str = "127.0.0.1"
    port: int = 50053
    dtype: str = "float32"
    mesh: MeshConfig = MeshConfig()
    slots: int = 8
    row_tile: int | None = None  # decode rows per tile; None: the engine's choice for the platform
    products: str = "auto"  # auto | native | xla: how token rows meet the weights (model.choose_products)
    prefill_chunk: int = 64  # longer prompts are prefilled this many tokens per decode step; 0: at once
    buckets: tuple[int, ...] | None = None  # None: powers of two from 32 up to the context
    max_queue: int = 64
    compile_cache: str | None = None
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    grace_seconds: float = 10.0
    random_seed: int = 0
    watchdog_seconds: float = 60.0  # 0 disables the decode-loop watchdog
    # Connections older than this get a GOAWAY so clients re-resolve and find new replicas (0: never).
    max_connection_age_seconds: float = 30.0
    max_connection_age_grace_seconds: float | None = None  # None: calls in flight are never cut
    tls: ServerTLS | None = None  # TLS, and mutual TLS when it names a client CA
    distributed: DistributedConfig | None = None  # set: this is process 0 (or a follower) of a multi-process replica


def default_buckets(sequence_len: int) -> tuple[int, ...]:
    """32, 64, ... up to 1024, capped at (and always including a bucket that reaches) the context."""
    out, b = [], 32
    while b < min(sequence_len, 1024):
        out.append(b)
        b *= 2
    out.append(min(b, sequence_len))
    return tuple(out)


def resolve(config: ServerConfig) -> tuple[ModelConfig, tuple[int, ...]]:
    """The model config and the prefill buckets; raises ConfigError/ValueError with a clear message."""
    if not config.checkpoint and not config.random_init:
        raise ValueError("no --checkpoint given: pass --checkpoint DIR (containing ckpt-0/), or --random-init "
                         "to serve random weights deliberately")
    model_cfg = load_model_config(config.config)
    validate(model_cfg, config.mesh)
    if config.row_tile and config.slots % min(config.row_tile, config.slots):
        raise ValueError(f"--slots ({config.slots}) must be a multiple of --row-tile ({config.row_tile})")
    buckets = config.buckets or default_buckets(model_cfg.sequence_len)
    return model_cfg, buckets


def make_info(config: ServerConfig, cfg: ModelConfig, buckets: tuple[int, ...]) -> model_pb2.GetInfoResponse:
    t = cfg.model
    devices = jax.devices()[:config.mesh.size]
    return model_pb2.GetInfoResponse(
        config=model_pb2.ModelConfig(
            vocab_size=cfg.vocab_size, pad_token=cfg.pad_token, eos_token=cfg.eos_token,
            sequence_len=cfg.sequence_len, embedding_init_scale=cfg.embedding_init_scale,
            output_multiplier_scale=cfg.output_multiplier_scale,
            embedding_multiplier_scale=cfg.embedding_multiplier_scale, emb_size=t.emb_size,
            widening_factor=t.widening_factor, key_size=t.key_size, num_q_heads=t.num_q_heads,
            num_kv_heads=t.num_kv_heads, num_layers=t.num_layers, attn_output_multiplier=t.attn_output_multiplier,
            num_experts=t.num_experts, num_selected_experts=t.num_selected_experts),
        mesh_data=config.mesh.data, mesh_model=config.mesh.model, slots=config.slots,
        prefill_buckets=list(buckets), dtype=config.dtype, max_queue=config.max_queue,
        checkpoint=config.checkpoint or "", random_weights=not config.checkpoint,
        platform=devices[0].platform if devices else "", device_count=len(devices))


def build_engine(config: ServerConfig, cfg: ModelConfig, buckets: tuple[int, ...]) -> Engine:
    """Load (or randomly initialise) the weights, build the Engine and compile all of it."""
    engine = load_engine(config, cfg, buckets)
    compile_engine(engine)
    return engine


def compile_engine(engine: Any) -> None:
    start = time.monotonic()
    timings = engine.compile_all()
    log.info("compiled all programs", extra={"seconds": round(time.monotonic() - start, 2), "programs": len(timings)})


def load_engine(config: ServerConfig, cfg: ModelConfig, buckets: tuple[int, ...]) -> Engine:
    """Load (or randomly initialise) the weights onto the mesh and build the (not yet compiled) Engine."""
    from model_service import checkpoint  # heavy imports stay out of module import
    from model_service.model import GrokModel, Products, choose_products
    from model_service.sharding import default_between_hosts, make_mesh

    between = None
    if config.distributed is not None:
        between = config.distributed.between_hosts or default_between_hosts(config.mesh, jax.process_count())
    mesh = make_mesh(config.mesh, between_hosts=between)
    read_before = _bytes_read()
    dtype = jnp.dtype(config.dtype)
    model = GrokModel(cfg, mesh, dtype, choose_products(config.products, mesh, dtype))
    pack = model.products is Products.NATIVE  # expert matrices packed for the kernel as they load
    log.info("products", extra={"requested": config.products, "using": model.products.value})
    start = time.monotonic()
    if config.checkpoint:
        params = checkpoint.load_params(config.checkpoint, cfg, mesh, dtype, progress=_progress, pack=pack)
    else:
        log.warning("serving RANDOM weights (--random-init): outputs are noise")
        params = checkpoint.random_params(cfg, mesh, dtype, config.random_seed, pack=pack)
    log.info("weights ready", extra={"seconds": round(time.monotonic() - start, 2), "process_id": jax.process_index(),
                                     "bytes_read": _bytes_read() - read_before})
    engine = Engine(model, params, cfg, mesh, config.slots, buckets, config.row_tile, config.prefill_chunk)
    start = time.monotonic()
    timings = engine.compile_all()
    log.info("compiled all programs", extra={"seconds": round(time.monotonic() - start, 2), "programs": len(timings)})
    return engine


def _bytes_read() -> int:
    """Bytes this process has read through read()/pread() so far (Linux /proc/self/io `rchar`; 0 elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _progress(done: int, total: int) -> None:
    if done == total or done % max(1, total // 10) == 0:
        log.info("loading weights", extra={"done": done, "total": total})


class ModelServer:
    """The gRPC server plus what it serves; `load()` makes it SERVING."""

    def __init__(self, config: ServerConfig, engine_factory: Callable[[], Engine] | None = None) -> None:
        self.config = config
        self.model_cfg, self.buckets = resolve(config)
        self.metrics = Metrics()
        self.servicer = ModelServicer(make_info(config, self.model_cfg, self.buckets), self.metrics)
        self.grpc = new_server("model", options=connection_age_options(
            config.max_connection_age_seconds, config.max_connection_age_grace_seconds))
        model_pb2_grpc.add_ModelServiceServicer_to_server(self.servicer, self.grpc)
        self.health: HealthReporter = add_health_and_reflection(self.grpc, [SERVICE_NAME])
        self.port = bind_port(self.grpc, config.host, config.port, config.tls)
        self.scheduler: Scheduler | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.group_broken = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_factory = engine_factory or self._default_engine

    def _default_engine(self) -> Any:
        if self.config.distributed is None:
            return build_engine(self.config, self.model_cfg, self.buckets)
        from model_service.distributed.group import leader_engine

        return leader_engine(self.config, self.model_cfg, self.buckets, self.on_group_broken)

    def on_group_broken(self, reason: str) -> None:
        """Called (from any thread) when a process of this replica's group is lost."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.group_broken.set)

    async def fail_group(self) -> int:
        """The group is broken: NOT_SERVING, refuse new work, let in-flight streams get UNAVAILABLE, stop."""
        await self.health.drain()
        await self.drain()
        await asyncio.sleep(BROKEN_LINGER_SECONDS)
        await self.grpc.stop(1.0)
        log.error("exiting: restart every process of this replica's group", extra={"exit_code": EXIT_GROUP_BROKEN})
        return EXIT_GROUP_BROKEN

    async def start(self) -> None:
        """Accept connections (health says NOT_SERVING until `load` finishes)."""
        self._loop = asyncio.get_running_loop()
        await self.grpc.start()
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        log.info("started, loading", extra={"port": self.port})

    async def load(self) -> None:
        engine = await asyncio.to_thread(self._engine_factory)
        self.scheduler = Scheduler(engine, self.config.max_queue, self.metrics)
        await asyncio.to_thread(self.scheduler.start)  # its first engine call may be a collective
        self.servicer.attach(self.scheduler)
        if self.config.watchdog_seconds > 0:
            watchdog = Watchdog(self.scheduler, self.health, self.servicer.refuse, self.config.watchdog_seconds)
            self._watchdog = asyncio.create_task(watchdog.run())
        await self.health.set(True)
        log.info("serving", extra={"port": self.port})

    async def drain(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()

    async def stop_scheduler(self) -> None:
        if self._watchdog is not None:  # a stopped decode loop is not a stall
            self._watchdog.cancel()
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
            close = getattr(self.scheduler.engine, "close", None)  # a LockstepEngine shuts its followers down
            if close is not None:
                await asyncio.to_thread(close)

    async def stop(self, grace: float = 0.0) -> None:
        await self.health.drain()
        await self.drain()
        await self.grpc.stop(grace)
        await self.stop_scheduler()


def build_server(config: ServerConfig, engine_factory: Callable[[], Engine] | None = None) -> tuple[ModelServer, int]:
    """The (not yet started) server and its bound port (port 0 picks a free one)."""
    server = ModelServer(config, engine_factory)
    return server, server.port


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code (1 if loading failed)."""
    server, _ = build_server(config)
    await server.start()
    serving = asyncio.create_task(serve_until_signal(server.grpc, server.health, config.grace_seconds,
                                                     before_stop=server.drain, after_stop=server.stop_scheduler))
    await asyncio.sleep(0)  # let it install the SIGTERM handler before the long load starts
    loading = asyncio.create_task(server.load())
    broken = asyncio.create_task(server.group_broken.wait())
    done, _ = await asyncio.wait({loading, serving, broken}, return_when=asyncio.FIRST_COMPLETED)
    if broken in done or (loading in done and isinstance(loading.exception(), GroupBroken)):
        serving.cancel()
        return await server.fail_group()
    if loading in done and loading.exception() is not None:
        log.error("loading failed", exc_info=loading.exception())
        serving.cancel()
        await server.stop(0)
        return 1
    done, _ = await asyncio.wait({serving, broken}, return_when=asyncio.FIRST_COMPLETED)
    if broken in done:
        serving.cancel()
        return await server.fail_group()
    broken.cancel()
    if not loading.done():
        # Stopped while loading/compiling: that thread cannot be interrupted and nothing is being
        # served, so leave now instead of waiting for the compilation to finish.
        log.info("stopped during loading")
        logging.shutdown()
        os._exit(0)
    return 0
