"""Shared, session-scoped fixtures for the tokenizer tests: the real Grok-1 tokenizer, a trained demo
model, and one running tokenizer service (subprocess) with small limits."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from grok.tokenizer.v1 import tokenizer_pb2_grpc
from tests.procs import GROK1_TOKENIZER, ROOT, Service, free_port
from tokenizer_service.tokenizer import Tokenizer

# Limits of the shared service; max-tokens comes from the environment to exercise GROK_TOKENIZER_*.
MAX_TEXT_BYTES = 2048
MAX_BATCH = 4
MAX_TOKENS = 256


@pytest.fixture(scope="session")
def grok_tokenizer() -> Tokenizer:
    return Tokenizer(GROK1_TOKENIZER)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The demo tokenizer, trained through its command line."""
    out = tmp_path_factory.mktemp("demo") / "tokenizer.model"
    subprocess.run([sys.executable, "-m", "demo_build.train_tokenizer", "--out", str(out)], cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    port = free_port()
    args = ["--model", str(GROK1_TOKENIZER), "--host", "127.0.0.1", "--port", str(port),
            "--max-text-bytes", str(MAX_TEXT_BYTES), "--max-batch", str(MAX_BATCH)]
    svc = Service("tokenizer_service", args, port, env={"GROK_TOKENIZER_MAX_TOKENS": str(MAX_TOKENS)},
                  log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield svc.wait_serving(timeout=60)
    finally:
        svc.terminate()


@pytest.fixture(scope="session")
def stub(service: Service) -> Iterator[tokenizer_pb2_grpc.TokenizerServiceStub]:
    with grpc.insecure_channel(service.address) as channel:
        yield tokenizer_pb2_grpc.TokenizerServiceStub(channel)
