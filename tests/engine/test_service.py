"""The model service as a process (health during start-up, grpcurl, metrics, SIGTERM) and its
admission errors (queue full, not yet loaded) against a FakeEngine hosted in-process."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.loading import ServerConfig
from model_service.server import ModelServer
from tests.engine.conftest import (
    GOLDEN_CHECKPOINT,
    GOLDEN_CONFIG,
    LoopThread,
    collect,
    golden_requests,
    golden_server_config,
)
from tests.engine.fake_engine import FakeEngine
from tests.procs import GOLDEN, ROOT, Service, free_port, grpcurl
from tests.waiting import wait_until


def health_status(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        except grpc.RpcError:
            return None


@pytest.fixture(scope="module")
def service_and_startup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, list[int | None]]]:
    port, metrics_port = free_port(), free_port()
    cache = tmp_path_factory.mktemp("compile_cache")
    svc = Service("model_service", ["--config", GOLDEN_CONFIG, "--checkpoint", GOLDEN_CHECKPOINT, "--host",
                                    "127.0.0.1", "--port", str(port), "--slots", "4",
                                    "--metrics-port", str(metrics_port)], port,
                  env={"GROK_MODEL_MESH": "1,1", "GROK_MODEL_MAX_QUEUE": "16", "GROK_MODEL_COMPILE_CACHE": str(cache)})
    svc.metrics_port = metrics_port  # type: ignore[attr-defined]
    svc.compile_cache = cache  # type: ignore[attr-defined]
    seen: list[int | None] = []  # every health status the service reported while it loaded

    def serving_or_gone() -> bool:
        if svc.proc.poll() is not None:
            return True  # the tests say what went wrong
        seen.append(health_status(svc.address))
        return seen[-1] == health_pb2.HealthCheckResponse.SERVING
    wait_until(serving_or_gone, 300, interval=0.1, message=lambda: f"never SERVING:\n{svc.logs()[-2000:]}")
    yield svc, seen
    svc.kill()


def test_health_is_not_serving_while_compiling_then_serving(service_and_startup: tuple[Service, list]) -> None:
    svc, seen = service_and_startup
    assert seen[-1] == health_pb2.HealthCheckResponse.SERVING, svc.logs()[-2000:]
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    assert seen.index(health_pb2.HealthCheckResponse.NOT_SERVING) < len(seen) - 1
    records = svc.log_records()
    compiled = next(i for i, r in enumerate(records) if r.get("msg") == "compiled all programs")
    serving = next(i for i, r in enumerate(records) if r.get("msg") == "serving")
    assert compiled < serving and records[serving]["port"] == svc.port
    assert any(svc.compile_cache.iterdir()), "the persistent compilation cache stayed empty"


def test_the_heap_built_while_loading_is_out_of_the_collectors_reach_once_serving(
        service_and_startup: tuple[Service, list]) -> None:
    """Loading and compiling leave ~200k long-lived Python objects (JAX, haiku, the engine); a full collection
    walking them took 136 ms on the medium config, a stall of every stream whenever it ran while serving. The
    service collects once and freezes that heap before it reports SERVING (as vLLM's servers do), and says how
    much it froze."""
    svc, _ = service_and_startup
    serving = next(r for r in svc.log_records() if r.get("msg") == "serving")
    assert serving.get("frozen_objects", 0) > 0, serving


def test_help_documents_every_flag_and_its_environment_variable() -> None:
    done = subprocess.run([sys.executable, "-m", "model_service", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    for flag in ("--checkpoint", "--random-init", "--dtype", "--mesh", "--slots", "--max-num-batched-tokens",
                 "--prefill-tokens", "--decode-slowdown", "--tile-rows", "--max-queue",
                 "--compile-cache", "--metrics-port"):
        assert flag in done.stdout
        assert "GROK_MODEL_" + flag[2:].replace("-", "_").upper() in done.stdout
    from model_service.config import CPU_STEP_TOKENS, GENERIC_STEP_TOKENS

    # the step's rows by default, as the backends take them (the help said 256 elsewhere after they became 1,024)
    assert f"(default: {CPU_STEP_TOKENS} on CPU, {GENERIC_STEP_TOKENS} elsewhere;" in " ".join(done.stdout.split())


def test_grpcurl_generate_with_a_golden_seeded_request_returns_reference_ids(
        service_and_startup: tuple[Service, list]) -> None:
    svc, _ = service_and_startup
    case = golden_requests()[2]
    q = case["request"]
    body = json.dumps({"token_ids": case["prompt_ids"], "temperature": q["temperature"], "top_p": q["nucleus_p"],
                       "seed": q["rng_seed"], "max_tokens": q["max_len"]})
    done = grpcurl("-plaintext", "-d", body, svc.address, "grok.model.v1.ModelService/Generate")
    assert done.returncode == 0, done.stderr
    decoder, text, i, ids = json.JSONDecoder(), done.stdout, 0, []
    while text[i:].strip():
        while text[i].isspace():
            i += 1
        message, i = decoder.raw_decode(text, i)
        ids += message.get("tokenIds", message.get("token_ids", []))
    assert ids == case["output_ids"]


def test_ids_only_responses_carry_the_same_ids_and_no_token_details(
        service_and_startup: tuple[Service, list]) -> None:
    """`ids_only` (the gateway sets it unless its caller asked for logprobs): no Token message per token, the
    same ids; top_logprobs still brings the details."""
    svc, _ = service_and_startup

    def replies(**fields: object) -> list[model_pb2.GenerateResponse]:
        with grpc.insecure_channel(svc.address) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            return list(stub.Generate(model_pb2.GenerateRequest(token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True,
                                                                 **fields), timeout=120))

    full, bare, asked = replies(), replies(ids_only=True), replies(ids_only=True, top_logprobs=2)
    ids = [i for r in full for i in r.token_ids]
    assert len(ids) == 6 and [i for r in bare for i in r.token_ids] == ids
    assert sum(len(r.tokens) for r in full) == 6 and sum(len(r.tokens) for r in bare) == 0
    assert [len(t.top_tokens) for r in asked for t in r.tokens] == [2] * 6
    assert bare[-1].completion_tokens == 6 and bare[-1].finish_reason == full[-1].finish_reason


def test_grpcurl_bad_request_is_invalid_argument(service_and_startup: tuple[Service, list]) -> None:
    svc, _ = service_and_startup
    done = grpcurl("-plaintext", "-d", json.dumps({"token_ids": [5] * 128}), svc.address,
                   "grok.model.v1.ModelService/Generate")
    assert done.returncode == 64 + grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "longest accepted is 127" in done.stderr


def test_metrics_endpoint_counts_requests(service_and_startup: tuple[Service, list]) -> None:
    svc, _ = service_and_startup
    with grpc.insecure_channel(svc.address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        collect(stub.Generate(model_pb2.GenerateRequest(token_ids=[9, 10], max_tokens=3), timeout=30))
        with pytest.raises(grpc.RpcError) as refused:  # counted too (not left to another test of the module)
            collect(stub.Generate(model_pb2.GenerateRequest(token_ids=[5] * 128), timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def page() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=5).read().decode()

    # The slot is released just after the last token is sent: give the decode thread a moment.
    def idle_page() -> str:
        text = page()
        return text if "grok_model_active_slots 0.0" in text else ""
    text = wait_until(idle_page, 5, interval=0.02, message="a slot stayed active")
    assert 'grok_model_requests_finished_total{finish_reason="length"}' in text
    assert 'grok_model_requests_total{code="OK"}' in text
    assert 'grok_model_requests_total{code="INVALID_ARGUMENT"}' in text
    assert "grok_model_decode_step_seconds_count" in text and "grok_model_active_slots 0.0" in text


def test_sigterm_drains_and_exits_cleanly(service_and_startup: tuple[Service, list]) -> None:
    svc, _ = service_and_startup
    assert svc.terminate() == 0
    messages = [json.loads(line).get("msg") for line in svc.log_path.read_text().splitlines() if line.startswith("{")]
    assert messages.index("draining") < messages.index("stopped")


def test_refuses_to_start_without_checkpoint_unless_random_init() -> None:
    done = subprocess.run([sys.executable, "-m", "model_service", "--config", GOLDEN_CONFIG, "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--random-init" in done.stderr


def test_run_prints_only_the_reference_completion() -> None:
    case = golden_requests()[2]
    q = case["request"]
    done = subprocess.run(
        [sys.executable, "-m", "model_service.run", "--config", GOLDEN_CONFIG, "--checkpoint", GOLDEN_CHECKPOINT,
         "--tokenizer", str(GOLDEN / "tokenizer.model"), "--prompt", q["prompt"], "--max-tokens", str(q["max_len"]),
         "--temperature", str(q["temperature"]), "--top-p", str(q["nucleus_p"]), "--seed", str(q["rng_seed"])],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == case["output_text"] + "\n"


def test_run_holds_the_weights_exactly_as_the_service_does() -> None:
    """The offline runner loads through the service's path: each weight in the same layout and type (with native
    products a float32 copy of a bfloat16 table would read twice the bytes a token)."""
    import argparse

    import jax

    from model_service import loading, run

    args = argparse.Namespace(config=GOLDEN_CONFIG, checkpoint=GOLDEN_CHECKPOINT, random_init=False,
                              dtype="float32", mesh="1,1")
    config = ServerConfig(config=GOLDEN_CONFIG, checkpoint=GOLDEN_CHECKPOINT, slots=1)
    service = loading.load_engine(config, loading.resolve(config))

    def layout(params: object) -> list[tuple[str, tuple[int, ...], str]]:
        leaves = jax.tree_util.tree_leaves_with_path(params)
        return [(jax.tree_util.keystr(path), tuple(leaf.shape), str(leaf.dtype)) for path, leaf in leaves]

    assert layout(run.load(args).params) == layout(service.params)


@pytest.fixture(scope="module")
def fake_loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def test_queue_full_is_resource_exhausted_and_not_loaded_is_unavailable(fake_loop: LoopThread) -> None:
    engine = FakeEngine(slots=1, vocab_size=512, sequence_len=128, step_delay=0.02)
    config = golden_server_config(slots=1, max_queue=1)
    server = fake_loop.run(_started(config, engine))
    address = f"127.0.0.1:{server.port}"
    try:
        with grpc.insecure_channel(address) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            request = model_pb2.GenerateRequest(token_ids=[20], max_tokens=50, ignore_eos=True)
            assert health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                collect(stub.Generate(request, timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in (err.value.details() or "")
            fake_loop.run(server.load())
            assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
            running = stub.Generate(request, timeout=30)
            next(running)  # it holds the only slot
            queued = stub.Generate(request, timeout=30)
            wait_until(lambda: server.scheduler.stats()["queued"] >= 1, 10, interval=0.005,
                       message="the second request never queued")
            with pytest.raises(grpc.RpcError) as err:
                collect(stub.Generate(request, timeout=5))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in (err.value.details() or "")
            assert len(collect(running)[0]) == 49 and len(collect(queued)[0]) == 50
    finally:
        fake_loop.run(server.stop(0))


async def _started(config: ServerConfig, engine: FakeEngine) -> ModelServer:
    server = ModelServer(config, lambda: engine)
    await server.start()
    return server


def test_sigterm_while_compiling_exits_promptly(tmp_path: pathlib.Path) -> None:
    port = free_port()
    svc = Service("model_service", ["--config", GOLDEN_CONFIG, "--checkpoint", GOLDEN_CHECKPOINT, "--host",
                                    "127.0.0.1", "--port", str(port), "--mesh", "1,1"], port, log_dir=tmp_path)
    try:
        def weights_ready() -> bool:
            assert svc.proc.poll() is None, svc.logs()[-2000:]
            return any(r.get("msg") == "weights ready" for r in svc.log_records())
        wait_until(weights_ready, 60, interval=0.05, message=lambda: svc.logs()[-2000:])
        assert health_status(svc.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        began = time.monotonic()
        assert svc.terminate(timeout=10) == 0
        assert time.monotonic() - began < 5
        assert "stopped during loading" in (tmp_path / svc.log_path.name).read_text()
    finally:
        svc.kill()
