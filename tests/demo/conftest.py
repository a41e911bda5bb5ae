"""The committed demo model (demo/): its record, its config, the documents it was trained on, and the whole
stack serving it (gateway -> tokenizer -> model, real processes on 127.0.0.1, gRPC and HTTP)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from gateway.client import GatewayClient
from model_service.config import ModelConfig, load_model_config
from demo_build.data import split_paragraphs
from tests.gateway.conftest import Stack
from tests.procs import ROOT, Service, free_port
from demo_build.train_tokenizer import CORPUS_DIR, corpus_documents

DEMO = ROOT / "demo"
DEMO_CONFIG = ROOT / "configs" / "demo.json"


@pytest.fixture(scope="session")
def record() -> dict:
    """demo/training.json, written by the run that produced the committed checkpoint."""
    return json.loads((DEMO / "training.json").read_text())


@pytest.fixture(scope="session")
def demo_cfg() -> ModelConfig:
    return load_model_config(str(DEMO_CONFIG))


@pytest.fixture(scope="session")
def trained_paragraphs(record: dict) -> list[str]:
    """The corpus paragraphs the model was trained on (the held-out ones excluded)."""
    train, _ = split_paragraphs(list(corpus_documents(CORPUS_DIR)), record["train_config"]["holdout_every"])
    return train


def paragraph_starting(paragraphs: list[str], opening: str) -> str:
    (found,) = [p for p in paragraphs if p.startswith(opening)]
    return found


def corpus_prose() -> str:
    """The prose of the corpus (*.txt), where every sentence an answer may quote comes from."""
    return "\n".join(path.read_text(encoding="utf-8") for path in sorted(CORPUS_DIR.glob("*.txt")))


def sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


@pytest.fixture(scope="session")
def demo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The committed demo model served as `make run` serves it, on free ports, with the HTTP API on."""
    logs = tmp_path_factory.mktemp("demo_stack")
    ports = [free_port() for _ in range(4)]
    tokenizer = Service("tokenizer_service", ["--model", str(DEMO / "tokenizer.model"), "--host", "127.0.0.1",
                                              "--port", str(ports[0])], ports[0], log_dir=logs)
    model = Service("model_service", ["--config", str(DEMO_CONFIG), "--checkpoint", str(DEMO / "checkpoint"),
                                      "--host", "127.0.0.1", "--port", str(ports[1]), "--slots", "2",
                                      "--buckets", "64,256"], ports[1], log_dir=logs)
    gateway = Service("gateway", ["--tokenizer", tokenizer.address, "--model", model.address, "--host", "127.0.0.1",
                                  "--port", str(ports[2]), "--http-port", str(ports[3])], ports[2], log_dir=logs)
    running = Stack(tokenizer, [model], gateway, ports[3])
    try:
        for service in (tokenizer, model, gateway):
            service.wait_serving(600)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def client(demo_stack: Stack) -> Iterator[GatewayClient]:
    with GatewayClient(demo_stack.address, timeout=120) as c:
        yield c
