"""Command line (flags, GROK_TOKENIZER_* environment, --help, startup errors) and the in-process
`build_server` (health, error mapping for unexpected failures)."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grok.tokenizer.v1 import tokenizer_pb2 as pb
from grok.tokenizer.v1 import tokenizer_pb2_grpc
from tests.procs import GROK1_TOKENIZER, ROOT
from tokenizer_service.__main__ import parse_args
from tokenizer_service.server import SERVICE_NAME, TokenizerConfig, build_server
from tokenizer_service.tokenizer import Tokenizer

FLAGS = ["--model", "--host", "--port", "--log-level", "--grace-seconds", "--max-text-bytes", "--max-batch",
         "--max-tokens"]


def test_flags_read_the_environment_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROK_TOKENIZER_MODEL", "/env/tokenizer.model")
    monkeypatch.setenv("GROK_TOKENIZER_PORT", "6000")
    monkeypatch.setenv("GROK_TOKENIZER_MAX_BATCH", "8")
    config = parse_args(["--port", "7000"])
    assert (config.model_path, config.port, config.max_batch) == ("/env/tokenizer.model", 7000, 8)
    assert (config.host, config.grace_seconds, config.max_text_bytes, config.max_tokens) == ("127.0.0.1", 10.0, 1 << 20, 1 << 20)


def test_bad_flag_values_are_rejected(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--model", "m", "--port", "70000"], ["--model", "m", "--max-batch", "0"],
                 ["--model", "m", "--grace-seconds", "-1"], []):
        with pytest.raises(SystemExit) as exited:
            parse_args(argv)
        assert exited.value.code == 2
    assert "--model" in capsys.readouterr().err


def test_help_documents_every_flag_and_its_variable() -> None:
    result = subprocess.run([sys.executable, "-m", "tokenizer_service", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for flag in FLAGS:
        assert flag in text and f"GROK_TOKENIZER_{flag[2:].replace('-', '_').upper()}" in text


@pytest.mark.parametrize("case", ["missing", "garbage", "unbindable"])
def test_startup_failures_exit_2_with_a_clear_log(tmp_path: pathlib.Path, case: str) -> None:
    model, host, needle = tmp_path / "nope.model", "127.0.0.1", "nope.model"
    if case == "garbage":
        model.write_bytes(b"not a model")
        needle = "is not a SentencePiece model"
    elif case == "unbindable":
        model, host, needle = GROK1_TOKENIZER, "192.0.2.1", "could not bind 192.0.2.1:0"  # TEST-NET-1: not ours
    result = subprocess.run([sys.executable, "-m", "tokenizer_service", "--model", str(model), "--host", host,
                             "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "startup failed" in result.stderr and needle in result.stderr
    assert "Traceback" not in result.stderr


async def _exercise_in_process(config: TokenizerConfig) -> None:
    server, port = await build_server(config)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Encode(pb.EncodeRequest(text="boom"), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INTERNAL and "request id" in caught.value.details()
            assert list((await stub.Encode(pb.EncodeRequest(text="fine"), timeout=10)).token_ids)
    finally:
        await server.stop(None)


def test_unexpected_error_is_internal_and_the_server_keeps_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    real_encode = Tokenizer.encode

    def flaky_encode(self: Tokenizer, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        if text == "boom":
            raise RuntimeError("simulated bug")
        return real_encode(self, text, add_bos, add_eos)

    monkeypatch.setattr(Tokenizer, "encode", flaky_encode)
    asyncio.run(_exercise_in_process(TokenizerConfig(model_path=str(GROK1_TOKENIZER), host="127.0.0.1", port=0)))
