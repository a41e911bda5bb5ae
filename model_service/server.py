"""The model service process: gRPC server first (NOT_SERVING), then load + compile, then SERVING.

`build_server` binds the port and registers ModelService, health and reflection; `ModelServer.load`
loads the weights, builds and compiles the Engine (loading.py: its step program) off the event loop, starts the Scheduler and only then flips health to SERVING. SIGTERM drains: health
NOT_SERVING, no new requests, in-flight streams get the grace period, then the decode thread stops.

In a multi-process replica (`ServerConfig.distributed`) this is process 0: its engine is a LockstepEngine
(model_service/distributed). When the group breaks, health turns NOT_SERVING, in-flight streams end with
UNAVAILABLE and `serve` returns EXIT_GROUP_BROKEN, so that the orchestrator restarts the group.

With `ServerConfig.engine_process` (--engine-process) the Engine, the Scheduler and its decode thread run in a child
process (engine_process.py, engine_core.py) and this one serves gRPC without touching the devices; the child
exiting unasked ends the service as a broken group does.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import jax

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.config import ModelConfig
from model_service.distributed import EXIT_GROUP_BROKEN
from model_service.distributed.group import leader_engine
from model_service.distributed.lockstep import GroupBroken
from model_service.engine_api import EngineLike
from model_service.engine_core import grammar_compiler
from model_service.engine_process import EngineProcess
from model_service.loading import ServerConfig, build_engine, resolve
from model_service.metrics import Metrics
from model_service.scheduler import Scheduler
from model_service.servicer import ModelServicer
from model_service.watchdog import Watchdog
from serving_common.grpc_server import HealthReporter, connection_age_options
from serving_common.lifecycle import assemble, drain, freeze_startup_heap, serve_until_signal

log = logging.getLogger(__name__)

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name
BROKEN_LINGER_SECONDS = 2.0  # NOT_SERVING and the failed streams' statuses go out before a broken group exits
BROKEN_STOP_SECONDS = 1.0  # then what is left of a broken group's calls gets this long


def make_info(config: ServerConfig, cfg: ModelConfig, devices: tuple[str, int] | None = None
              ) -> model_pb2.GetInfoResponse:
    """GetInfo's answer; `devices` (platform, count) as an engine process reported them, else this process's."""
    t = cfg.model
    if devices is None:
        local = jax.devices()[:config.mesh.size]
        devices = (local[0].platform if local else "", len(local))
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
        dtype=config.dtype, max_queue=config.max_queue,
        checkpoint=config.checkpoint or "", random_weights=not config.checkpoint,
        platform=devices[0], device_count=devices[1], generate_many=True)


class ModelServer:
    """The gRPC server plus what it serves; `load()` makes it SERVING."""

    def __init__(self, config: ServerConfig, engine_factory: Callable[[], EngineLike] | None = None) -> None:
        self.config = config
        self.model_cfg = resolve(config)
        self.metrics = Metrics()
        # With an engine process this process never touches the devices: GetInfo's are filled in once it is ready.
        self.servicer = ModelServicer(make_info(config, self.model_cfg, ("", 0) if config.engine_process else None),
                                      self.metrics)
        built = assemble("model", SERVICE_NAME,
                         lambda server: model_pb2_grpc.add_ModelServiceServicer_to_server(self.servicer, server),
                         config.host, config.port, config.tls, options=connection_age_options(
                             config.max_connection_age_seconds, config.max_connection_age_grace_seconds),
                         uds=config.uds)
        self.grpc = built.server
        self.health: HealthReporter = built.health
        self.port = built.port
        self.scheduler: Scheduler | EngineProcess | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.group_broken = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._given_factory = engine_factory  # an engine process calls it there (importable by name)
        self._engine_factory = engine_factory or self._default_engine

    def _default_engine(self) -> Any:
        if self.config.distributed is None:
            return build_engine(self.config, self.model_cfg)
        return leader_engine(self.config, self.model_cfg, self.on_group_broken)

    def on_group_broken(self, reason: str) -> None:
        """Called (from any thread) when a process of this replica's group is lost, or the engine process exited."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.group_broken.set)

    async def fail_group(self) -> int:
        """The group is broken: NOT_SERVING, refuse new work, let in-flight streams get UNAVAILABLE, stop."""
        async def refuse_and_linger() -> None:
            await self.drain()
            await asyncio.sleep(BROKEN_LINGER_SECONDS)

        await drain(self.grpc, self.health, BROKEN_LINGER_SECONDS + BROKEN_STOP_SECONDS, refuse_and_linger)
        log.error("exiting: restart every process of this replica's group", extra={"exit_code": EXIT_GROUP_BROKEN})
        return EXIT_GROUP_BROKEN

    async def start(self) -> None:
        """Accept connections (health says NOT_SERVING until `load` finishes)."""
        self._loop = asyncio.get_running_loop()
        await self.grpc.start()
        if self.config.metrics_port or self.config.metrics_uds:
            self.metrics.serve(self.config.metrics_port, self.config.metrics_host, self.config.metrics_uds)
        log.info("started, loading", extra=self.where())

    def where(self) -> dict[str, object]:
        """Where it listens, for its log lines."""
        return {"uds": self.config.uds} if self.config.uds else {"port": self.port}

    async def load(self) -> None:
        if self.config.engine_process:
            self.scheduler = await self._load_engine_process()
        else:
            engine = await asyncio.to_thread(self._engine_factory)
            grammars = await asyncio.to_thread(grammar_compiler, self.config, engine.vocab_size)
            self.scheduler = Scheduler(engine, self.config.max_queue, self.metrics, self.config.prefill_tokens,
                                       grammars, self.config.prefix_caching, self.config.speculative,
                                       self.config.decode_slowdown)
            await asyncio.to_thread(self.scheduler.start)  # its first engine call may be a collective
        self.servicer.attach(self.scheduler)  # type: ignore[arg-type]  # EngineProcess has Scheduler's surface
        if self.config.watchdog_seconds > 0:
            watchdog = Watchdog(self.scheduler, self.health, self.servicer.refuse, self.config.watchdog_seconds)
            self._watchdog = asyncio.create_task(watchdog.run())
        frozen = freeze_startup_heap()
        await self.health.set(True)
        log.info("serving", extra={**self.where(), "frozen_objects": frozen})

    async def _load_engine_process(self) -> EngineProcess:
        """Spawn the engine process and wait until it serves; its exit makes this service exit as a broken group."""
        core = EngineProcess(self.config, self.metrics, self._given_factory, on_exit=self.on_group_broken,
                             on_broken=self.on_group_broken)
        core.start()  # on the loop's thread, which lives as long as the service (the child dies with it)
        try:
            ready = await asyncio.to_thread(core.wait_ready)
        except BaseException:
            await asyncio.to_thread(core.stop, 5.0)
            raise
        self.servicer.info = make_info(self.config, self.model_cfg, (ready.platform, ready.device_count))
        return core

    async def drain(self) -> None:
        self.servicer.drain()
        if self.scheduler is not None:
            self.scheduler.close()

    async def stop_scheduler(self) -> None:
        if self._watchdog is not None:  # a stopped decode loop is not a stall
            self._watchdog.cancel()
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
            if self.scheduler.guidance.grammars is not None:  # its constraint worker processes
                self.scheduler.guidance.grammars.close()
            close = getattr(self.scheduler.engine, "close", None)  # a LockstepEngine shuts its followers down
            if close is not None:
                await asyncio.to_thread(close)

    async def stop(self, grace: float = 0.0) -> None:
        await drain(self.grpc, self.health, grace, self.drain, self.stop_scheduler)


def build_server(config: ServerConfig, engine_factory: Callable[[], EngineLike] | None = None
                 ) -> tuple[ModelServer, int]:
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
