"""Session fixtures: one compiled golden Engine, and one in-process model service built on it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, Protocol

import grpc
import jax
import pytest

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.config import MeshConfig
from model_service.engine import Engine
from model_service.engine_api import EngineLike
from model_service.loading import ServerConfig, build_engine, resolve
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from model_service.server import ModelServer
from tests.procs import GOLDEN

GOLDEN_CONFIG = str(GOLDEN / "config.json")
GOLDEN_CHECKPOINT = str(GOLDEN / "checkpoint")
SLOTS = 8


def golden_requests() -> list[dict[str, Any]]:
    return json.loads((GOLDEN / "pipeline_fp32.json").read_text())["requests"]


def golden_sampling(q: dict[str, Any]) -> SamplingSettings:
    """The reference request `q`'s sampling settings."""
    return SamplingSettings(temperature=q["temperature"], top_p=q["nucleus_p"])


def golden_message(case: dict[str, Any]) -> model_pb2.GenerateRequest:
    """The reference's request as a GenerateRequest (its max_len counts generated tokens)."""
    q = case["request"]
    return model_pb2.GenerateRequest(token_ids=case["prompt_ids"], temperature=q["temperature"],
                                     top_p=q["nucleus_p"], seed=q["rng_seed"], max_tokens=q["max_len"])


def golden_server_config(**overrides: Any) -> ServerConfig:
    base = dict(config=GOLDEN_CONFIG, checkpoint=GOLDEN_CHECKPOINT, host="127.0.0.1", port=0,
                mesh=MeshConfig(1, 1), slots=SLOTS, max_queue=64,
                huge_pages=False)  # the test process's heap stays as it is; services the tests start use the default
    return ServerConfig(**{**base, **overrides})


@pytest.fixture(scope="session")
def golden_engine() -> Engine:
    config = golden_server_config()
    return build_engine(config, resolve(config))


class Runner(Protocol):
    def __call__(self, engine: EngineLike, *, max_queue: int = 8, start: bool = True, **options: Any) -> Scheduler: ...


@pytest.fixture
def running() -> Iterator[Runner]:
    """Schedulers over a given engine, started (unless start=False) and stopped after the test."""
    made: list[Scheduler] = []

    def make(engine: EngineLike, *, max_queue: int = 8, start: bool = True, **options: Any) -> Scheduler:
        scheduler = Scheduler(engine, max_queue, **options)
        made.append(scheduler)
        if start:
            scheduler.start()
        return scheduler

    yield make
    for scheduler in made:
        scheduler.stop()


class LoopThread:
    """An asyncio loop on a thread, so sync tests can host a grpc.aio server in-process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def start_server(loop_thread: LoopThread, config: ServerConfig, engine_factory: Any) -> ModelServer:
    async def up() -> ModelServer:
        server = ModelServer(config, engine_factory)
        await server.start()
        await server.load()
        return server

    return loop_thread.run(up())


@pytest.fixture(scope="session")
def golden_service(loop_thread: LoopThread, golden_engine: Engine) -> Iterator[ModelServer]:
    server = start_server(loop_thread, golden_server_config(), lambda: golden_engine)
    yield server
    loop_thread.run(server.stop(1.0))


@pytest.fixture(scope="session")
def golden_stub(golden_service: ModelServer) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{golden_service.port}")
    yield model_pb2_grpc.ModelServiceStub(channel)
    channel.close()


def collect(stream: Any) -> tuple[list[int], list[model_pb2.GenerateResponse]]:
    responses = list(stream)
    return [t for r in responses for t in r.token_ids], responses


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


@pytest.fixture
def compilations() -> Iterator[list[str]]:
    seen: list[str] = []

    def listen(event: str, seconds: float, **kwargs: object) -> None:
        if event == COMPILE_EVENT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)
