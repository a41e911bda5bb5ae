"""One complete training run: tokenizer, corpus, training, int8 export, evaluation, and its record.

The record (training.json) is what a later run is compared against: the settings, the corpus and tokenizer
hashes, the loss curve, float and int8 losses on training and held-out text, and greedy samples of the
served int8 model.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece

from model_service.config import ModelConfig, model_config_to_dict
from demo_build import data, export, network, train_tokenizer
from demo_build.loop import LogEntry, TrainConfig, train

SAMPLE_PROMPTS = ("The gateway", "A request travels like this.", "The answer to life the universe and everything is")
# Chat samples: these conversations rendered by the gateway's chat template, as /v1/chat/completions sends them.
SAMPLE_CHATS = ((("user", "Hello!"),), (("user", "What does the gateway do?"),),
                (("system", "You are a helpful assistant."), ("user", "What does the gateway do?")))
PACKAGES = ("jax", "jaxlib", "optax", "numpy", "sentencepiece", "dm-haiku")


def corpus_sha256(corpus_dir: pathlib.Path) -> str:
    digest = hashlib.sha256()
    for path in sorted([*corpus_dir.glob("*.txt"), *corpus_dir.glob("*.jsonl")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def float_loss(model_cfg: ModelConfig, params: Any, tokens: np.ndarray, weights: np.ndarray) -> float:
    losses = jax.jit(lambda p, t: network.token_losses(model_cfg, p, t))(params, jnp.asarray(tokens))
    return float(jnp.sum(losses * weights) / weights.sum())


def train_prefix(model_cfg: ModelConfig, train_cfg: TrainConfig, corpus_dir: pathlib.Path,
                 steps: int) -> tuple[LogEntry, ...]:
    corpus = data.load_corpus(corpus_dir, train_tokenizer.train(corpus_dir), train_cfg.holdout_every)
    return train(model_cfg, train_cfg, corpus.train, corpus.train_starts, stop_after=steps).log


def _report(entry: LogEntry) -> None:
    print(f"step {entry.step}: loss {entry.loss:.4f} ({entry.seconds:.0f} s)", file=sys.stderr, flush=True)


def _evaluate(model_cfg: ModelConfig, params: Any, corpus: data.Corpus, checkpoint: pathlib.Path,
              seq_len: int) -> dict[str, float]:
    served_model, served_params = export.load_served(model_cfg, checkpoint)
    losses = {}
    for name, stream in (("train", corpus.train), ("heldout", corpus.heldout)):
        tokens, weights = data.eval_windows(stream, seq_len + 1, model_cfg.pad_token)
        losses[f"{name}_float"] = float_loss(model_cfg, params, tokens, weights)
        losses[f"{name}_int8"] = export.served_loss(served_model, served_params, tokens, weights)
    return losses


def sample_prompts() -> list[str]:
    """The plain sample prompts, then the chat samples as the gateway's default template renders them."""
    from gateway.http.chat import ChatTemplate
    from gateway.http.schemas import ChatMessage

    template = ChatTemplate.load()
    chats = [template.render([ChatMessage(role=role, content=text) for role, text in chat]) for chat in SAMPLE_CHATS]
    return [*SAMPLE_PROMPTS, *chats]


def _samples(model_cfg: ModelConfig, checkpoint: pathlib.Path, tokenizer: bytes) -> dict[str, str]:
    sp = sentencepiece.SentencePieceProcessor(model_proto=tokenizer)
    model, params = export.load_served(model_cfg, checkpoint)
    return {prompt: sp.decode(export.greedy(model, params, sp.encode(prompt), 48, model_cfg.eos_token, 128))
            for prompt in sample_prompts()}


def _install(staging: pathlib.Path, out: pathlib.Path) -> None:
    """Move the generated items into `out`, replacing earlier ones (other files there are kept)."""
    out.mkdir(parents=True, exist_ok=True)
    for item in ("tokenizer.model", "checkpoint", "training.json"):
        target = out / item
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(staging / item, target)


def build(model_cfg: ModelConfig, train_cfg: TrainConfig, corpus_dir: pathlib.Path, out: pathlib.Path,
          config_name: str) -> dict[str, Any]:
    tokenizer = train_tokenizer.train(corpus_dir)
    corpus = data.load_corpus(corpus_dir, tokenizer, train_cfg.holdout_every)
    result = train(model_cfg, train_cfg, corpus.train, corpus.train_starts, report=_report)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        staging = pathlib.Path(tmp)
        (staging / "tokenizer.model").write_bytes(tokenizer)
        export.write_trained_checkpoint(staging / "checkpoint", model_cfg, result.params)
        losses = _evaluate(model_cfg, result.params, corpus, staging / "checkpoint", train_cfg.seq_len)
        produced = {
            "command": "python -m demo_build --out " + str(out),
            "model_config": {"file": config_name, **model_config_to_dict(model_cfg)},
            "train_config": train_cfg.__dict__,
            "corpus": {"sha256": corpus_sha256(corpus_dir), "paragraphs": len(corpus.train_paragraphs)
                       + len(corpus.heldout_paragraphs), "train_tokens": len(corpus.train),
                       "heldout_tokens": len(corpus.heldout), "train_sentence_starts": len(corpus.train_starts),
                       "heldout_paragraphs": list(corpus.heldout_paragraphs)},
            "tokenizer_sha256": hashlib.sha256(tokenizer).hexdigest(),
            "losses": losses,
            "quantisation_gap_heldout": losses["heldout_int8"] - losses["heldout_float"],
            "log": [entry._asdict() for entry in result.log],
            "seconds": round(result.seconds, 1),
            "samples": _samples(model_cfg, staging / "checkpoint", tokenizer),
            "versions": {name: importlib.metadata.version(name) for name in PACKAGES},
        }
        (staging / "training.json").write_text(json.dumps(produced, indent=1) + "\n")
        _install(staging, out)
    return produced
