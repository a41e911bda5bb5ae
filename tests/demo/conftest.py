"""The committed demo model (demo/): its record, its config, and corpus paragraphs it was trained on."""

from __future__ import annotations

import json

import pytest

from model_service.config import ModelConfig, load_model_config
from model_service.train.data import split_paragraphs
from tests.procs import ROOT
from tokenizer_service.train_demo import CORPUS_DIR, corpus_lines

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
    train, _ = split_paragraphs(list(corpus_lines(CORPUS_DIR)), record["train_config"]["holdout_every"])
    return train


def paragraph_starting(paragraphs: list[str], opening: str) -> str:
    (found,) = [p for p in paragraphs if p.startswith(opening)]
    return found
