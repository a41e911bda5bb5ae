"""One complete training run: tokenizer, corpus, training, int8 export, evaluation, and its record.

The record (training.json) is what a later run is compared against: the settings, the corpus and tokenizer
hashes, the loss curve, float and int8 losses on training and held-out text, greedy samples of the served
int8 model, and where it ran (the JAX backend and device kind) at what speed. The folder also gets config.json,
the model config the checkpoint was trained with, which the stack serves it with (scripts/run_stack.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import pathlib
import shutil
import sys
import tarfile
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece

from model_service.config import ModelConfig, model_config_to_dict
from demo_build import data, export, network, train_tokenizer
from demo_build.loop import LogEntry, TrainConfig, TrainResult, train
from demo_build.train_tokenizer import CorpusDirs

SAMPLE_PROMPTS = ("The gateway", "A request travels like this.", "The answer to life the universe and everything is")
# Chat samples: these conversations rendered by the gateway's chat template, as /v1/chat/completions sends them.
SAMPLE_CHATS = ((("user", "Hello!"),), (("user", "What does the gateway do?"),),
                (("system", "You are a helpful assistant."), ("user", "What does the gateway do?")))
PACKAGES = ("jax", "jaxlib", "optax", "numpy", "sentencepiece", "dm-haiku")


TAR_PART_BYTES = 15 << 20
ITEMS = ("tokenizer.model", "config.json", "checkpoint", "training.json")  # what a build writes into its folder


def corpus_sha256(corpus_dir: CorpusDirs) -> str:
    """Over every *.txt and *.jsonl file, folder by folder (one folder: the hash older records carry)."""
    digest = hashlib.sha256()
    for folder in [corpus_dir] if isinstance(corpus_dir, pathlib.Path) else corpus_dir:
        for path in sorted([*folder.glob("*.txt"), *folder.glob("*.jsonl")]):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def float_loss(model_cfg: ModelConfig, params: Any, tokens: np.ndarray, weights: np.ndarray) -> float:
    """The float model's loss, its products in float32 also on an accelerator (whose default is bfloat16 passes)."""
    with jax.default_matmul_precision("float32"):
        losses = jax.jit(lambda p, t: network.token_losses(model_cfg, p, t))(params, jnp.asarray(tokens))
    return float(jnp.sum(losses * weights) / weights.sum())


def train_prefix(model_cfg: ModelConfig, train_cfg: TrainConfig, corpus_dir: CorpusDirs,
                 steps: int) -> tuple[LogEntry, ...]:
    tokenizer = train_tokenizer.train(corpus_dir, model_cfg.vocab_size)
    corpus = data.load_corpus(corpus_dir, tokenizer, train_cfg.holdout_every)
    return train(model_cfg, train_cfg, corpus.train, corpus.train_starts, stop_after=steps).log


class _Reporter:
    """Prints each log entry with the steps per second since the previous one."""

    def __init__(self) -> None:
        self.previous = LogEntry(0, 0.0, 0.0)

    def __call__(self, entry: LogEntry) -> None:
        rate = (entry.step - self.previous.step) / max(entry.seconds - self.previous.seconds, 1e-9)
        print(f"step {entry.step}: loss {entry.loss:.4f} ({entry.seconds:.0f} s, {rate:.2f} steps/s)",
              file=sys.stderr, flush=True)
        self.previous = entry


def _evaluate(model_cfg: ModelConfig, params: Any, corpus: data.Corpus, checkpoint: pathlib.Path,
              train_cfg: TrainConfig) -> dict[str, float]:
    served_model, served_params = export.load_served(model_cfg, checkpoint)
    losses = {}
    for name, stream in (("train", corpus.train), ("heldout", corpus.heldout)):
        tokens, weights = data.spaced(*data.eval_windows(stream, train_cfg.seq_len + 1, model_cfg.pad_token),
                                      train_cfg.eval_windows)
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
    for item in ITEMS:
        target = out / item
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(staging / item, target)


def platform() -> dict[str, Any]:
    device = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": device.device_kind, "devices": jax.device_count()}


def build(model_cfg: ModelConfig, train_cfg: TrainConfig, corpus_dir: CorpusDirs, out: pathlib.Path,
          config_name: str, command: str) -> dict[str, Any]:
    began = time.monotonic()
    folders = [corpus_dir] if isinstance(corpus_dir, pathlib.Path) else list(corpus_dir)
    export.check_tensor_files(model_cfg)
    tokenizer = train_tokenizer.train(folders, model_cfg.vocab_size)
    corpus = data.load_corpus(folders, tokenizer, train_cfg.holdout_every)
    result = train(model_cfg, train_cfg, corpus.train, corpus.train_starts, report=_Reporter())
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        staging = pathlib.Path(tmp)
        (staging / "tokenizer.model").write_bytes(tokenizer)
        (staging / "config.json").write_text(json.dumps(model_config_to_dict(model_cfg), indent=2) + "\n")
        export.write_trained_checkpoint(staging / "checkpoint", model_cfg, result.params)
        losses = _evaluate(model_cfg, result.params, corpus, staging / "checkpoint", train_cfg)
        produced = {
            "command": command,
            "model_config": {"file": config_name, **model_config_to_dict(model_cfg)},
            "train_config": train_cfg.__dict__,
            "corpus": _corpus_record(folders, corpus),
            "tokenizer_sha256": hashlib.sha256(tokenizer).hexdigest(),
            "losses": losses,
            "quantisation_gap_heldout": losses["heldout_int8"] - losses["heldout_float"],
            "log": [entry._asdict() for entry in result.log],
            **_run_record(train_cfg, result),
            "samples": _samples(model_cfg, staging / "checkpoint", tokenizer),
            "versions": {name: importlib.metadata.version(name) for name in PACKAGES},
        }
        produced["build_seconds"] = round(time.monotonic() - began, 1)  # tokenizer to samples, all of it
        (staging / "training.json").write_text(json.dumps(produced, indent=1) + "\n")
        _install(staging, out)
    return produced


def _corpus_record(folders: list[pathlib.Path], corpus: data.Corpus) -> dict[str, Any]:
    root = pathlib.Path(__file__).resolve().parent.parent
    names = [str(f.resolve().relative_to(root)) if f.resolve().is_relative_to(root) else str(f) for f in folders]
    return {"folders": names, "sha256": corpus_sha256(folders),
            "bytes": sum(p.stat().st_size for pattern in ("*.txt", "*.jsonl")
                         for p in train_tokenizer.corpus_files(folders, pattern)),
            "paragraphs": len(corpus.train_paragraphs) + len(corpus.heldout_paragraphs),
            "train_tokens": len(corpus.train), "heldout_tokens": len(corpus.heldout),
            "train_sentence_starts": len(corpus.train_starts), "heldout_paragraphs": list(corpus.heldout_paragraphs)}


def _run_record(train_cfg: TrainConfig, result: TrainResult) -> dict[str, Any]:
    """Where and how fast it ran: `seconds` is the training loop, the first step's compilation included
    (`build_seconds`, beside it in the record, is the whole build)."""
    steady = result.seconds - result.first_step_seconds
    rate = round((result.steps - 1) / steady, 3) if steady > 0 else None
    return {"seconds": round(result.seconds, 1), "first_step_seconds": round(result.first_step_seconds, 1),
            "steps_done": result.steps, "steps_per_second": rate,
            "tokens_trained": result.steps * train_cfg.batch_size * train_cfg.seq_len, "platform": platform()}


def write_tar(out: pathlib.Path, tar_dir: pathlib.Path, part_bytes: int = TAR_PART_BYTES) -> list[pathlib.Path]:
    """The built folder's items as one tar stream, members under demo/, cut into DIR/demo.tar.000, .001, ... of
    at most `part_bytes` each (a machine that hands files back may cap their size):
    `cat DIR/demo.tar.* | tar -x` at the repository root unpacks it."""
    tar_dir.mkdir(parents=True, exist_ok=True)
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w") as tar:
        for item in ITEMS:
            tar.add(out / item, arcname=f"demo/{item}")
    whole = stream.getvalue()
    parts = []
    for number, begin in enumerate(range(0, len(whole), part_bytes)):
        parts.append(tar_dir / f"demo.tar.{number:03d}")
        parts[-1].write_bytes(whole[begin:begin + part_bytes])
    return parts
