"""--engine-process: the Engine and its decode loop in a child process give what the in-thread service gives.

One model service with an engine process serves most tests (module fixture) beside the in-thread golden service
(conftest); two more run as real `python -m model_service --engine-process` processes, for what ends a process:
the engine process killed (open streams end UNAVAILABLE, the service exits non-zero) and SIGTERM (no orphan)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.distributed import EXIT_GROUP_BROKEN
from model_service.engine_process import EngineProcess
from model_service.metrics import Metrics
from model_service.server import ModelServer
from model_service.structured import Vocabulary
from tests.engine.conftest import (
    GOLDEN_CHECKPOINT,
    GOLDEN_CONFIG,
    LoopThread,
    golden_server_config,
    start_server,
)
from tests.procs import GOLDEN, Service, free_port
from tests.waiting import wait_until

TOKENIZER = str(GOLDEN / "tokenizer.model")
REGEX = r"[a-z]{2,6}( [0-9]{1,3})?"
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def engine_service(loop_thread: LoopThread) -> Iterator[ModelServer]:
    server = start_server(loop_thread, golden_server_config(engine_process=True, tokenizer=TOKENIZER), None)
    yield server
    loop_thread.run(server.stop(1.0))
    assert not server.scheduler.process.is_alive()  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def engine_stub(engine_service: ModelServer) -> Iterator[model_pb2_grpc.ModelServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{engine_service.port}")
    yield model_pb2_grpc.ModelServiceStub(channel)
    channel.close()


def outcome(stub: model_pb2_grpc.ModelServiceStub, request: model_pb2.GenerateRequest) -> dict[int, list[bytes]]:
    """Each sample's tokens (ids, probabilities and alternatives, as bytes), prompt scores and finish, in order:
    how the stream cut them into messages depends on timing, what they are must not."""
    out: dict[int, list[bytes]] = {}
    for response in stub.Generate(request, timeout=120):
        sample = out.setdefault(response.index, [])
        sample += [t.SerializeToString() for t in (*response.prompt_logprobs, *response.tokens)]
        if response.finish_reason:
            sample.append(b"finish %d" % response.finish_reason)
    return out


CASES = {
    "greedy": model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=12, top_logprobs=3, prompt_logprobs=2),
    "seeded": model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                                        top_logprobs=4),
    "n=2": model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=10, temperature=1.0, seed=3, n=2,
                                     top_logprobs=1),
    "stop": model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=40, temperature=1.0, seed=11,
                                      stop_token_ids=[12, 30, 31, 40, 77], ignore_eos=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tokens_and_probabilities_equal_the_in_thread_services_bit_for_bit(
        name: str, engine_stub: model_pb2_grpc.ModelServiceStub,
        golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    request = CASES[name]
    child = outcome(engine_stub, request)
    assert child == outcome(golden_stub, request)
    assert sorted(child) == list(range(request.n or 1))
    assert all(len(tokens) > 1 for tokens in child.values())


def test_the_engine_process_reports_its_devices_and_the_service_never_started_jax_here(
        engine_service: ModelServer, engine_stub: model_pb2_grpc.ModelServiceStub) -> None:
    info = engine_stub.GetInfo(model_pb2.GetInfoRequest())
    assert (info.platform, info.device_count) == ("cpu", 1)
    assert engine_service.scheduler.process.pid != os.getpid()  # type: ignore[union-attr]


def test_the_decode_loops_metrics_reach_the_services_metrics(
        engine_service: ModelServer, engine_stub: model_pb2_grpc.ModelServiceStub) -> None:
    registry = engine_service.metrics.registry
    tokens = registry.get_sample_value("grok_model_generated_tokens_total") or 0.0
    steps = registry.get_sample_value("grok_model_decode_step_seconds_count") or 0.0
    list(engine_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=6, ignore_eos=True), timeout=60))
    wait_until(lambda: registry.get_sample_value("grok_model_generated_tokens_total") == tokens + 6, 10)
    # A count of step observations replayed from the child (one per step, at least one per token), not a time.
    assert registry.get_sample_value("grok_model_decode_step_seconds_count") >= steps + 6
    assert registry.get_sample_value("grok_model_requests_finished_total", {"finish_reason": "length"}) >= 1
    assert registry.get_sample_value("grok_model_kv_cache_usage_perc") is not None


def test_a_cancelled_stream_frees_its_slot_within_a_step(
        engine_service: ModelServer, engine_stub: model_pb2_grpc.ModelServiceStub) -> None:
    registry = engine_service.metrics.registry
    before = registry.get_sample_value("grok_model_steps_after_cancel_bucket", {"le": "1.0"}) or 0.0
    call = engine_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=100, ignore_eos=True),
                                timeout=120)
    next(call)
    assert engine_service.scheduler.stats()["active"] == 1  # type: ignore[union-attr]
    call.cancel()
    wait_until(lambda: engine_service.scheduler.stats() == {  # type: ignore[union-attr]
        "active": 0, "free": engine_service.config.slots, "queued": 0}, 30)
    wait_until(lambda: (registry.get_sample_value("grok_model_steps_after_cancel_bucket", {"le": "1.0"}) or 0.0)
               == before + 1, 10)


def test_a_bad_request_is_refused_at_once_with_invalid_argument(
        engine_stub: model_pb2_grpc.ModelServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(engine_stub.Generate(model_pb2.GenerateRequest(token_ids=[1, 10**6], max_tokens=2), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids" in caught.value.details()


def test_a_structured_request_follows_its_constraint_and_a_bad_one_is_invalid(
        engine_stub: model_pb2_grpc.ModelServiceStub) -> None:
    request = model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=24, temperature=1.0, seed=9, regex=REGEX)
    ids = [t for r in engine_stub.Generate(request, timeout=120) for t in r.token_ids]
    vocabulary = Vocabulary(TOKENIZER)
    text = vocabulary.lltokenizer.decode_str([t for t in ids if t != 2])  # 2: the golden model's EOS
    assert re.fullmatch(REGEX, text), text
    with pytest.raises(grpc.RpcError) as caught:
        list(engine_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=4,
                                                            json_schema='{"type": "nonsense"}'), timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "json_schema" in caught.value.details()


# ---- real processes -----------------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def engine_pid(service: Service) -> int:
    """The service's engine process (multiprocessing's resource tracker is a child too)."""
    for pid in children(service.proc.pid):
        command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in command:
            return pid
    raise AssertionError(f"no engine process among {children(service.proc.pid)}")


def alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def start_service(tmp_path: pathlib.Path) -> Service:
    port = free_port()
    service = Service("model_service", ["--config", GOLDEN_CONFIG, "--checkpoint", GOLDEN_CHECKPOINT, "--port",
                                        str(port), "--slots", "4", "--huge-pages", "off", "--grace-seconds", "5"],
                      port, env={"GROK_MODEL_ENGINE_PROCESS": "1"}, log_dir=tmp_path)
    return service.wait_serving(300)


def test_killing_the_engine_process_ends_open_streams_unavailable_and_the_service_exits_non_zero(
        tmp_path: pathlib.Path) -> None:
    service = start_service(tmp_path)
    try:
        child = engine_pid(service)
        with grpc.insecure_channel(service.address) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            call = stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=120, ignore_eos=True),
                                 timeout=120)
            next(call)
            os.kill(child, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as caught:
                list(call)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "engine process exited (killed by signal 9" in caught.value.details()
            # The streams' error and the health change reach the event loop apart (engine_process._child_exited):
            # a check right after the error could still read SERVING on a busy box (make test did once).
            checks = health_pb2_grpc.HealthStub(channel)
            status = lambda: checks.Check(health_pb2.HealthCheckRequest(), timeout=10).status  # noqa: E731
            wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert service.proc.wait(60) == EXIT_GROUP_BROKEN
    finally:
        service.kill()


def test_stopping_the_service_stops_its_engine_process(tmp_path: pathlib.Path) -> None:
    service = start_service(tmp_path)
    try:
        child = engine_pid(service)
        with grpc.insecure_channel(service.address) as channel:  # an in-flight stream finishes in the grace period
            stub = model_pb2_grpc.ModelServiceStub(channel)
            call = stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=30, ignore_eos=True),
                                 timeout=120)
            next(call)
            service.proc.send_signal(signal.SIGTERM)
            rest = list(call)
        assert rest[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
        assert service.proc.wait(60) == 0
        wait_until(lambda: not alive(child), 10)
    finally:
        service.kill()


def test_a_checkpoint_the_engine_process_cannot_load_makes_the_service_exit_1_with_its_message(
        tmp_path: pathlib.Path) -> None:
    port = free_port()
    missing = tmp_path / "no-checkpoint"
    service = Service("model_service", ["--config", GOLDEN_CONFIG, "--checkpoint", str(missing), "--port", str(port),
                                        "--engine-process"], port, log_dir=tmp_path)
    try:
        assert service.proc.wait(120) == 1
        assert "the engine process failed to start" in service.logs()
        assert str(missing) in service.logs()
    finally:
        service.kill()


def test_the_engine_process_dies_with_a_killed_service(tmp_path: pathlib.Path) -> None:
    service = start_service(tmp_path)
    try:
        child = engine_pid(service)
        service.proc.kill()
        service.proc.wait(30)
        wait_until(lambda: not alive(child), 10)
    finally:
        service.kill()


def test_an_engine_factory_spawn_cannot_send_is_refused_with_what_to_pass_instead() -> None:
    core = EngineProcess(golden_server_config(engine_process=True), Metrics(), lambda: None)
    with pytest.raises(ValueError, match="importable by name"):
        core.start()


def test_a_stopped_engine_process_trips_the_watchdog_and_serving_resumes_when_it_continues(
        loop_thread: LoopThread) -> None:
    server = start_server(loop_thread, golden_server_config(engine_process=True, watchdog_seconds=1.0), None)
    child = server.scheduler.process.pid  # type: ignore[union-attr]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            call = stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=120, ignore_eos=True),
                                 timeout=120)
            next(call)
            os.kill(child, signal.SIGSTOP)
            try:
                with pytest.raises(grpc.RpcError) as caught:
                    list(call)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "stopped making progress" in caught.value.details()
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING
            finally:
                os.kill(child, signal.SIGCONT)
            wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10).status ==
                       health_pb2.HealthCheckResponse.SERVING, 20)
            assert len(list(stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=3), timeout=60))) >= 1
    finally:
        loop_thread.run(server.stop(1.0))
