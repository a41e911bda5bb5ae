"""The demo corpus as token streams, and reproducible batches of training windows.

Each paragraph (a non-empty line of the corpus) is encoded without BOS, as prompts are at serving time, and
followed by EOS, so the model learns to end a paragraph and a request can finish with finish_reason EOS.
Every `holdout_every`-th paragraph goes to a held-out stream the model never trains on (for measuring loss,
and the int8 model's loss against the float model's).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import sentencepiece

from tokenizer_service.train_demo import corpus_lines


@dataclass(frozen=True)
class Corpus:
    """Training and held-out token streams (int32, paragraphs each ending in EOS)."""

    train: np.ndarray  # [N_train]
    heldout: np.ndarray  # [N_heldout]
    train_paragraphs: tuple[str, ...]
    heldout_paragraphs: tuple[str, ...]


def split_paragraphs(paragraphs: Sequence[str], holdout_every: int) -> tuple[list[str], list[str]]:
    """Paragraph i is held out when (i + 1) % holdout_every == 0 (none when holdout_every is 0)."""
    train, heldout = [], []
    for i, text in enumerate(paragraphs):
        (heldout if holdout_every and (i + 1) % holdout_every == 0 else train).append(text)
    return train, heldout


def encode_stream(sp: sentencepiece.SentencePieceProcessor, paragraphs: Sequence[str]) -> np.ndarray:
    ids: list[int] = []
    for text in paragraphs:
        ids += sp.encode(text) + [sp.eos_id()]
    return np.asarray(ids, np.int32)


def load_corpus(corpus_dir: pathlib.Path, tokenizer_model: bytes, holdout_every: int) -> Corpus:
    sp = sentencepiece.SentencePieceProcessor(model_proto=tokenizer_model)
    train, heldout = split_paragraphs(list(corpus_lines(corpus_dir)), holdout_every)
    return Corpus(encode_stream(sp, train), encode_stream(sp, heldout), tuple(train), tuple(heldout))


def training_batches(stream: np.ndarray, batch: int, length: int, seed: int) -> Iterator[np.ndarray]:
    """Endless batches [batch, length] of windows starting at uniformly drawn offsets (numpy PCG64 `seed`)."""
    if len(stream) < length:
        raise ValueError(f"training text has {len(stream)} tokens, fewer than one window of {length}")
    rng = np.random.default_rng(seed)
    offsets = np.arange(length)
    while True:
        starts = rng.integers(0, len(stream) - length + 1, batch)
        yield stream[starts[:, None] + offsets]


def eval_windows(stream: np.ndarray, length: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows [W, length] covering `stream`, each overlapping the previous by one token so every token but
    the first is a target exactly once; the last is padded. Returns (tokens, weights [W, length - 1])."""
    step = length - 1
    count = max(1, -(-(len(stream) - 1) // step))
    tokens = np.full((count, length), pad, np.int32)
    weights = np.zeros((count, step), np.float32)
    for w in range(count):
        chunk = stream[w * step: w * step + length]
        tokens[w, :len(chunk)] = chunk
        weights[w, :len(chunk) - 1] = 1.0
    return tokens, weights
