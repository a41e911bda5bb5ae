"""Benchmark workloads: prompts cut from real text to exact token counts, and request arrival times.

Prompts come from the corpus that ships with the project (demo_build/corpus: English
prose about serving). Token counts are those of the SentencePiece model the stack serves (for the
medium config the real Grok-1 tokenizer), encoded without BOS as the gateway encodes prompts, so a
prompt of `input_len` tokens reaches the model as exactly `input_len` ids. Every request sets
`ignore_eos` and `max_tokens = output_len`, so output lengths are exact too.

- `fixed`: every request has the same input and output length (one point of a length grid).
- `random`: lengths drawn uniformly from [len * (1 - ratio), len * (1 + ratio)] (vLLM's random
  range ratio), different text for every request.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sentencepiece as spm

from demo_build.train_tokenizer import CORPUS_DIR


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: the text, its token ids under the served tokenizer, the output length."""

    prompt: str
    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate; `name` is how results and plots refer to it."""

    kind: str  # "fixed" or "random"
    input_len: int
    output_len: int
    num_prompts: int
    range_ratio: float = 0.0  # random only
    seed: int = 0

    @property
    def name(self) -> str:
        if self.kind == "fixed":
            return f"fixed-in{self.input_len}-out{self.output_len}"
        return f"random-in{self.input_len}-out{self.output_len}-r{self.range_ratio:g}"


def corpus_text(directory: pathlib.Path = CORPUS_DIR) -> str:
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt corpus files in {directory}")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


class PromptCutter:
    """Cuts spans of exactly n tokens out of the corpus (checked by re-encoding the decoded span)."""

    def __init__(self, tokenizer_path: str | pathlib.Path, text: str | None = None) -> None:
        self.sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
        self.ids: list[int] = self.sp.encode(text if text is not None else corpus_text())

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def cut(self, n: int, rng: np.random.Generator) -> tuple[str, tuple[int, ...]]:
        """A prompt whose encoding (no BOS) is exactly n tokens, starting at a random corpus offset."""
        if n < 1:
            raise ValueError(f"prompt length must be >= 1, got {n}")
        if n > len(self.ids):
            raise ValueError(f"prompt length {n} exceeds the corpus ({len(self.ids)} tokens)")
        start = int(rng.integers(0, len(self.ids) - n + 1))
        for attempt in range(len(self.ids)):
            s = (start + attempt) % (len(self.ids) - n + 1)
            text = self.sp.decode(self.ids[s:s + n])
            ids = self.encode(text)
            # A span that begins inside a word or a multi-byte character re-encodes differently: skip it.
            if len(ids) == n and text.strip():
                return text, tuple(ids)
        raise ValueError(f"no span of the corpus encodes to exactly {n} tokens")


def lengths(spec: WorkloadSpec, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(input_len, output_len) per request."""
    if spec.kind == "fixed":
        return [(spec.input_len, spec.output_len)] * spec.num_prompts
    if spec.kind != "random":
        raise ValueError(f"unknown workload kind {spec.kind!r} (fixed or random)")
    if not 0 <= spec.range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {spec.range_ratio}")

    def draw(mean: int) -> np.ndarray:
        low = max(1, int(np.floor(mean * (1 - spec.range_ratio))))
        high = max(low, int(np.ceil(mean * (1 + spec.range_ratio))))
        return rng.integers(low, high + 1, spec.num_prompts)

    return [(int(i), int(o)) for i, o in zip(draw(spec.input_len), draw(spec.output_len))]


def build(spec: WorkloadSpec, cutter: PromptCutter, context: int | None = None) -> list[BenchRequest]:
    """The workload's requests (deterministic for a seed); checks each fits the model's context."""
    rng = np.random.default_rng(spec.seed)
    out = []
    for input_len, output_len in lengths(spec, rng):
        if context is not None and input_len + output_len > context:
            raise ValueError(f"input {input_len} + output {output_len} tokens exceed the model's context of "
                             f"{context}: lower --input-len/--output-len")
        text, ids = cutter.cut(input_len, rng)
        out.append(BenchRequest(text, ids, output_len))
    return out


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of n requests at `rate` requests/s.

    Gaps are gamma distributed with shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson
    process; below 1 burstier, above 1 more regular), then rescaled so the last request is sent at
    n/rate exactly, as vLLM does, so runs with different seeds offer the same average load. An
    infinite rate sends everything at once (a closed loop when a concurrency limit applies).
    """
    if n < 1:
        return []
    if rate == float("inf"):
        return [0.0] * n
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"request rate and burstiness must be positive (got {rate}, {burstiness})")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    times *= (n / rate) / times[-1]
    return [float(t) for t in times]


def grid(kind: str, input_lens: Sequence[int], output_lens: Sequence[int], num_prompts: int, range_ratio: float,
         seed: int) -> list[WorkloadSpec]:
    """Every (input, output) combination of the two length lists."""
    return [WorkloadSpec(kind, i, o, num_prompts, range_ratio if kind == "random" else 0.0, seed)
            for i in input_lens for o in output_lens]
