"""The demo corpus as token streams, and reproducible batches of training windows.

Each paragraph (a non-empty line of the corpus) is encoded without BOS, as prompts are at serving time, and
followed by EOS, so the model learns to end a paragraph and a request can finish with finish_reason EOS.
Training windows start at sentence starts: a prompt is read from position 0 at serving time, and a model
trained only on windows starting at random offsets saw almost no sentence at position 0 (it recited its
corpus inside long windows but not from a short prompt).
Every `holdout_every`-th paragraph goes to a held-out stream the model never trains on (for measuring loss,
and the int8 model's loss against the float model's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import sentencepiece

from demo_build.train_tokenizer import CorpusDirs, corpus_documents


@dataclass(frozen=True)
class Corpus:
    """Training and held-out token streams (int32, paragraphs each ending in EOS)."""

    train: np.ndarray  # [N_train]
    heldout: np.ndarray  # [N_heldout]
    train_starts: np.ndarray  # [S] offsets in `train` where a sentence (or paragraph) begins
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


def sentence_starts(sp: sentencepiece.SentencePieceProcessor, stream: np.ndarray) -> np.ndarray:
    """Offsets of tokens that begin a word right after EOS or after a piece ending in '.', '!' or '?'."""
    pieces = [sp.id_to_piece(int(i)) for i in stream]
    starts = [i for i in range(len(stream)) if i == 0 or stream[i - 1] == sp.eos_id()
              or (pieces[i].startswith("\u2581") and pieces[i - 1].endswith((".", "!", "?")))]
    return np.asarray(starts, np.int64)


def load_corpus(corpus_dir: CorpusDirs, tokenizer_model: bytes, holdout_every: int) -> Corpus:
    sp = sentencepiece.SentencePieceProcessor(model_proto=tokenizer_model)
    train, heldout = split_paragraphs(list(corpus_documents(corpus_dir)), holdout_every)
    stream = encode_stream(sp, train)
    return Corpus(stream, encode_stream(sp, heldout), sentence_starts(sp, stream), tuple(train), tuple(heldout))


def training_batches(stream: np.ndarray, starts: np.ndarray, batch: int, length: int, seed: int,
                     eos: int | None = None, copy_share: float = 0.0) -> Iterator[np.ndarray]:
    """Endless batches [batch, length] of windows beginning at uniformly drawn `starts` (numpy PCG64 `seed`).
    The stream wraps around, so the last sentences start full windows too.

    With `copy_share` > 0, that share of the windows (drawn per window) are copies instead: a paragraph drawn
    uniformly, its `eos`, then the stream again from that paragraph's start (the paragraph a second time and
    what follows it). They teach the model to continue text that its prompt already holds, as a reader
    quoting a document asks it to (and as n-gram speculation drafts)."""
    if len(stream) < length:
        raise ValueError(f"training text has {len(stream)} tokens, fewer than one window of {length}")
    rng = np.random.default_rng(seed)
    circular = np.concatenate([stream, stream, stream[:length]])
    offsets = np.arange(length)
    paragraphs = np.flatnonzero(np.concatenate([[True], stream[:-1] == eos])) if copy_share else None
    while True:
        chosen = starts[rng.integers(0, len(starts), batch)]
        windows = circular[chosen[:, None] + offsets]
        if paragraphs is not None:
            for row in np.flatnonzero(rng.random(batch) < copy_share):
                first = int(paragraphs[rng.integers(0, len(paragraphs))])
                end = first + int(np.argmax(circular[first:] == eos)) + 1  # past the paragraph's EOS
                once = circular[first:end]
                windows[row] = np.concatenate([once, circular[first:first + length]])[:length]
        yield windows


def spaced(tokens: np.ndarray, weights: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """At most `count` of eval_windows' windows, evenly spaced over the stream (all of them when count is 0):
    a large corpus is measured on a sample, so evaluating stays seconds on a CPU."""
    if not count or len(tokens) <= count:
        return tokens, weights
    chosen = np.linspace(0, len(tokens) - 1, count).round().astype(int)
    return tokens[chosen], weights[chosen]


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
