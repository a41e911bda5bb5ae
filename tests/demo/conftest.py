"""The committed demo model (demo/): its record, its config, the documents it was trained on, and the whole
stack serving it as `make run` starts it (scripts/run_stack.py: gateway -> tokenizer -> model, real processes on
127.0.0.1, gRPC and HTTP)."""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator

import pytest

from gateway.client import GatewayClient
from model_service.config import ModelConfig, load_model_config
from demo_build.data import split_paragraphs
from tests.demo.launcher import Launched
from tests.procs import ROOT
from demo_build.train_tokenizer import CORPUS_DIR, corpus_documents, corpus_files

DEMO = ROOT / "demo"
DEMO_CONFIG = DEMO / "config.json"  # the model config the committed checkpoint was trained with and is served with


def read_record() -> dict:
    """demo/training.json, written by the run that produced the committed checkpoint."""
    return json.loads((DEMO / "training.json").read_text())


def corpus_folders(record: dict) -> tuple[pathlib.Path, ...]:
    """The corpus folders the committed model learned from (records before presets name none: the small one)."""
    return tuple(ROOT / folder for folder in record["corpus"].get("folders", [])) or (CORPUS_DIR,)


@pytest.fixture(scope="session")
def record() -> dict:
    return read_record()


@pytest.fixture(scope="session")
def demo_cfg() -> ModelConfig:
    return load_model_config(str(DEMO_CONFIG))


@pytest.fixture(scope="session")
def trained_paragraphs(record: dict) -> list[str]:
    """The corpus paragraphs the model was trained on (the held-out ones excluded)."""
    train, _ = split_paragraphs(list(corpus_documents(corpus_folders(record))), record["train_config"]["holdout_every"])
    return train


def paragraph_starting(paragraphs: list[str], opening: str) -> str:
    (found,) = [p for p in paragraphs if p.startswith(opening)]
    return found


def corpus_prose() -> str:
    """The prose of the corpus (*.txt), where every sentence an answer may quote comes from."""
    return "\n".join(path.read_text(encoding="utf-8") for path in corpus_files(corpus_folders(read_record()), "*.txt"))


def sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


@pytest.fixture(scope="session")
def demo_stack(jax_cache: str) -> Iterator[Launched]:
    """The stack `make run` starts (scripts/run_stack.py with its defaults: the committed demo model, structured
    output on, the HTTP API on) on free ports, with the session's compile cache; ready once its sample is shown."""
    launched = Launched(["--compile-cache", jax_cache])
    try:
        yield launched.wait_ready()
    finally:
        if launched.proc.poll() is None:
            launched.stop()
        else:
            launched.kill()


@pytest.fixture(scope="session")
def client(demo_stack: Launched) -> Iterator[GatewayClient]:
    with GatewayClient(demo_stack.address, timeout=120) as c:
        yield c
