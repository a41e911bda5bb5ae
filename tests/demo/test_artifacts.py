"""The committed demo model: made from the shipped corpus by the training script, int8 in the released format,
small, and its quantisation measured through the served network."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from model_service.checkpoint import read_tensor
from model_service.config import ModelConfig, model_config_to_dict
from model_service.model.params import tensor_specs
from demo_build import data, export
from demo_build.record import corpus_sha256
from tests.demo.conftest import DEMO, corpus_folders
from demo_build import train_tokenizer

MAX_FILE_BYTES = 5 * 1000 * 1000  # every committed file stays under 5 MB
MAX_CHECKPOINT_BYTES = 40 * 1024 * 1024
# Stated margin: int8 quantisation may cost at most this much held-out (and training) loss, in nats per token.
QUANTISATION_MARGIN = 0.02


@pytest.fixture(scope="module")
def corpus(record: dict) -> data.Corpus:
    return data.load_corpus(corpus_folders(record), (DEMO / "tokenizer.model").read_bytes(),
                            record["train_config"]["holdout_every"])


@pytest.fixture(scope="module")
def served_losses(demo_cfg: ModelConfig, record: dict, corpus: data.Corpus) -> dict[str, float]:
    """Losses of the committed int8 checkpoint, read by the service's loader and run by the served network, on
    the windows the record's losses were measured on."""
    model, params = export.load_served(demo_cfg, DEMO / "checkpoint")
    length = record["train_config"]["seq_len"] + 1
    count = record["train_config"].get("eval_windows", 0)
    return {name: export.served_loss(model, params,
                                     *data.spaced(*data.eval_windows(stream, length, demo_cfg.pad_token), count))
            for name, stream in (("train", corpus.train), ("heldout", corpus.heldout))}


def test_committed_tokenizer_is_the_one_trained_from_the_shipped_corpus(record: dict, demo_cfg: ModelConfig) -> None:
    tokenizer = train_tokenizer.train(corpus_folders(record), demo_cfg.vocab_size)
    assert (DEMO / "tokenizer.model").read_bytes() == tokenizer


def test_record_names_the_committed_corpus_tokenizer_and_config(record: dict, demo_cfg: ModelConfig) -> None:
    # Editing the corpus, the tokenizer or demo/config.json without retraining (make demo) fails here.
    assert record["corpus"]["sha256"] == corpus_sha256(corpus_folders(record))
    assert record["tokenizer_sha256"] == hashlib.sha256((DEMO / "tokenizer.model").read_bytes()).hexdigest()
    model_config = {k: v for k, v in record["model_config"].items() if k != "file"}
    assert model_config == model_config_to_dict(demo_cfg)


def test_checkpoint_is_int8_in_the_released_format_in_files_under_5_mb(demo_cfg: ModelConfig) -> None:
    files = sorted((DEMO / "checkpoint" / "ckpt-0").iterdir())
    specs = tensor_specs(demo_cfg)
    assert [f.name for f in files] == [f"tensor{i:05d}_000" for i in range(len(specs))]
    assert sum(f.stat().st_size for f in files) <= MAX_CHECKPOINT_BYTES
    assert max(f.stat().st_size for f in DEMO.rglob("*") if f.is_file()) < MAX_FILE_BYTES
    for path, spec in zip(files, specs):
        leaf = read_tensor(path)
        if spec.quantized:  # attention and expert matrices, as in the released Grok-1 checkpoint
            assert leaf[0].dtype == np.int8 and leaf[0].shape == spec.shape, spec.ckpt_path
        else:
            assert leaf.dtype == np.float32 and leaf.shape == spec.shape, spec.ckpt_path


def test_served_int8_losses_are_the_recorded_ones(record: dict, served_losses: dict[str, float]) -> None:
    assert served_losses["heldout"] == pytest.approx(record["losses"]["heldout_int8"], abs=1e-3)
    assert served_losses["train"] == pytest.approx(record["losses"]["train_int8"], abs=1e-3)


def test_int8_heldout_loss_is_within_the_stated_margin_of_the_float_model(record: dict,
                                                                          served_losses: dict[str, float]) -> None:
    # The float weights are not shipped; their losses were measured by the same run (training.json).
    assert served_losses["heldout"] - record["losses"]["heldout_float"] <= QUANTISATION_MARGIN
    assert served_losses["train"] - record["losses"]["train_float"] <= QUANTISATION_MARGIN


def test_the_model_has_learned_its_corpus(demo_cfg: ModelConfig, served_losses: dict[str, float]) -> None:
    # It recites its training text; unseen text stays hard for a model that memorised ~11k tokens.
    assert served_losses["train"] < 0.05 * math.log(demo_cfg.vocab_size)
