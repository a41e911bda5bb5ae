"""The model service process: gRPC server first (NOT_SERVING), then load + compile, then SERVING.

`build_server` binds the port and registers ModelService, health and reflection; `ModelServer.load`
loads the weights, builds and compiles the Engine (every prefill bucket and the decode step) off the
event loop, starts the Scheduler and only then flips health to SERVING. SIGTERM drains: health
NOT_SERVING, no new requests, in-flight streams get the grace period, then the decode thread stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import jax
import jax.numpy as jnp

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.config import MeshConfig, ModelConfig, load_model_config, validate
from model_service.engine import Engine
from model_service.metrics import Metrics
from model_service.scheduler import Scheduler
from model_service.servicer import ModelServicer
from serving_common.grpc_server import HealthReporter, add_health_and_reflection, bind, serve_until_signal

log = logging.getLogger(__name__)

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name


@dataclass(frozen=True)
class ServerConfig:
    """Everything `python -m model_service` is configured with (parsed once in __main__)."""

    config: str
    checkpoint: str | None
    random_init: bool = False
    host: str = "0.0.0.0"
    port: int = 50053
    dtype: str = "float32"
    mesh: MeshConfig = MeshConfig()
    slots: int = 8
    row_tile: int | None = None  # decode rows per tile; None: the engine's choice for the platform
    prefill_chunk: int = 64  # longer prompts are prefilled this many tokens per decode step; 0: at once
    buckets: tuple[int, ...] | None = None  # None: powers of two from 32 up to the context
    max_queue: int = 64
    compile_cache: str | None = None
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    grace_seconds: float = 10.0
    random_seed: int = 0


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
    from model_service import checkpoint  # heavy imports stay out of module import
    from model_service.model import GrokModel
    from model_service.sharding import make_mesh

    mesh = make_mesh(config.mesh)
    dtype = jnp.dtype(config.dtype)
    start = time.monotonic()
    if config.checkpoint:
        params = checkpoint.load_params(config.checkpoint, cfg, mesh, dtype, progress=_progress)
    else:
        log.warning("serving RANDOM weights (--random-init): outputs are noise")
        params = checkpoint.random_params(cfg, mesh, dtype, config.random_seed)
    log.info("weights ready", extra={"seconds": round(time.monotonic() - start, 2)})
    engine = Engine(GrokModel(cfg, mesh, dtype), params, cfg, mesh, config.slots, buckets, config.row_tile,
                    config.prefill_chunk)
    start = time.monotonic()
    timings = engine.compile_all()
    log.info("compiled all programs", extra={"seconds": round(time.monotonic() - start, 2), "programs": len(timings)})
    return engine


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
        self.grpc = grpc.aio.server()
        model_pb2_grpc.add_ModelServiceServicer_to_server(self.servicer, self.grpc)
        self.health: HealthReporter = add_health_and_reflection(self.grpc, [SERVICE_NAME])
        self.port = bind(self.grpc, config.host, config.port)
        self.scheduler: Scheduler | None = None
        self._engine_factory = engine_factory or (lambda: build_engine(config, self.model_cfg, self.buckets))

    async def start(self) -> None:
        """Accept connections (health says NOT_SERVING until `load` finishes)."""
        await self.grpc.start()
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        log.info("started, loading", extra={"port": self.port})

    async def load(self) -> None:
        engine = await asyncio.to_thread(self._engine_factory)
        self.scheduler = Scheduler(engine, self.config.max_queue, self.metrics)
        self.scheduler.start()
        self.servicer.attach(self.scheduler)
        await self.health.set(True)
        log.info("serving", extra={"port": self.port})

    async def drain(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()

    async def stop_scheduler(self) -> None:
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)

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
    done, _ = await asyncio.wait({loading, serving}, return_when=asyncio.FIRST_COMPLETED)
    if loading in done and loading.exception() is not None:
        log.error("loading failed", exc_info=loading.exception())
        serving.cancel()
        await server.stop(0)
        return 1
    await serving
    if not loading.done():
        # Stopped while loading/compiling: that thread cannot be interrupted and nothing is being
        # served, so leave now instead of waiting for the compilation to finish.
        log.info("stopped during loading")
        logging.shutdown()
        os._exit(0)
    return 0
