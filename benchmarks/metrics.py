"""Serving metrics with `vllm bench serve`'s definitions, computed from per-request timestamps.

A request is measured by the client: when it was sent, when each streamed chunk that carried at
least one token arrived, when the stream ended, and how many tokens it produced. From those:

- TTFT: first token chunk minus send time.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), per request with more than one token (the first
  token is excluded, so prefill and queueing do not count as decode time).
- ITL: every gap between consecutive token chunks of a request, pooled over all requests (a chunk
  that carries several tokens is one gap, as vLLM counts it).
- E2E latency: end of the stream minus send time.
- Throughputs divide by the benchmark's wall duration (first send to last end, warm-up excluded);
  goodput counts only the requests that met every stated SLO. Failed requests are counted, never
  retried, and contribute nothing else.

Pure functions on plain data so the arithmetic is tested on synthetic timestamps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Metrics reported with mean / median / std / percentiles, in milliseconds (vLLM's key names).
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# A TTFT taken apart by the server's Timings: in the model's scheduler (of it, queued for a slot), and the rest
TTFT_PARTS = ("ttft_engine", "ttft_queue", "ttft_outside")
# Scalars that summaries carry from run to run (medians and spreads are taken over these).
SCALAR_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
               "max_output_tokens_per_s", "max_concurrent_requests")


@dataclass
class RequestResult:
    """What the client saw of one request (times from time.perf_counter, in seconds)."""

    prompt_len: int
    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with >= 1 token
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    end: float = 0.0
    error: str = ""  # "" on success, else "CODE: message"
    text: str = ""
    server_prompt_tokens: int = -1  # what the server counted (usage), -1 if it did not say
    first_text: float = 0.0  # arrival of the first chunk with non-empty text (0: none, or not recorded)
    server_queue: float = -1.0  # the server's Timings: seconds waiting for a slot (-1: it did not say)
    server_prefill: float = -1.0  # and from admission to its first token drawn

    @property
    def success(self) -> bool:
        return not self.error and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else 0.0

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def engine_ttft(self) -> float | None:
        """Of the TTFT, the part the model's scheduler reports (queued, then admitted until its first token was
        drawn); None where the server did not say."""
        return self.server_queue + self.server_prefill if self.server_queue >= 0 and self.server_prefill >= 0 else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for single-token requests."""
        n = self.output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class Slo:
    """Goodput objectives in milliseconds (None: not constrained)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def met_by(self, r: RequestResult) -> bool:
        # As vLLM: a single-token request has TPOT 0 for goodput purposes.
        tpot = r.tpot or 0.0
        return all(limit is None or value * 1e3 <= limit for value, limit in (
            (r.ttft, self.ttft_ms), (tpot, self.tpot_ms), (r.latency, self.e2el_ms)))

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
                if v is not None}


def parse_slo(pairs: Sequence[str]) -> Slo:
    """`["ttft:500", "tpot:100"]` -> Slo (milliseconds), as vLLM's --goodput takes them."""
    values: dict[str, float] = {}
    for pair in pairs:
        name, sep, raw = pair.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput objective {pair!r}: use NAME:MILLISECONDS with NAME in ttft, tpot, e2el")
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"goodput objective {pair!r}: the value must be a finite number of ms >= 0")
        values[f"{name}_ms"] = value
    return Slo(**values)


def percentile_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def distribution(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean / median / std / pNN of `values` (seconds) in milliseconds; zeros for no values (as vLLM)."""
    data = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1e3
    out = {"mean": float(np.mean(data)), "median": float(np.median(data)), "std": float(np.std(data))}
    for p in percentiles:
        out[f"p{percentile_key(p)}"] = float(np.percentile(data, p))
    return out


def peak_output_rate(results: Sequence[RequestResult]) -> tuple[float, int]:
    """Most output tokens in any one-second bucket since the first send, and the peak number of
    requests in flight (vLLM's max_output_tokens_per_s / max_concurrent_requests)."""
    done = [r for r in results if r.success]
    if not done:
        return 0.0, 0
    origin = min(r.start for r in done)
    buckets: dict[int, int] = {}
    for r in done:
        for t, n in zip(r.chunk_times, r.chunk_tokens):
            buckets[int(t - origin)] = buckets.get(int(t - origin), 0) + n
    events = sorted([(r.start, 1) for r in done] + [(r.end, -1) for r in done])  # ends sort before starts
    peak = level = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return float(max(buckets.values())), peak


def compute(results: Sequence[RequestResult], duration: float, percentiles: Sequence[float] = (50, 90, 99),
            slo: Slo = Slo()) -> dict[str, Any]:
    """One run's result in `vllm bench serve`'s layout (scalars, per-metric stats, per-request lists)."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if slo.met_by(r)) if not slo.empty else 0
    peak_rate, peak_requests = peak_output_rate(results)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if not slo.empty else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_rate,
        "max_concurrent_requests": peak_requests,
    }
    series = {"ttft": [r.ttft for r in done], "tpot": [t for r in done if (t := r.tpot) is not None],
              "itl": [gap for r in done for gap in r.itl], "e2el": [r.latency for r in done]}
    for name in LATENCY_METRICS:
        for stat, value in distribution(series[name], percentiles).items():
            out[f"{stat}_{name}_ms"] = value
    engine = [(r.ttft, t, r.server_queue) for r in done if (t := r.engine_ttft) is not None]
    if engine and len(engine) == len(done):
        # Where a TTFT goes: in the model's scheduler (its queue, then the steps to the first draw), and outside it
        # (the request's way in through the services, the first token's way out to the client).
        for name, values in zip(TTFT_PARTS, ([t for _, t, _ in engine], [q for _, _, q in engine],
                                             [a - t for a, t, _ in engine])):
            for stat, value in distribution(values, percentiles).items():
                out[f"{stat}_{name}_ms"] = value
    out.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "itls": [r.itl if r.success else [] for r in results],
        "latencies": [r.latency if r.success else 0.0 for r in results],
        "start_times": [r.start for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
    })
    return out


def itl_quantiles(results: Iterable[RequestResult], points: int = 99) -> list[float]:
    """ITL quantiles 1..points/(points+1) in ms: a compact ITL distribution for summaries and plots."""
    gaps = [g for r in results if r.success for g in r.itl]
    if not gaps:
        return []
    qs = np.linspace(0, 100, points + 2)[1:-1]
    return [float(v) for v in np.percentile(np.asarray(gaps) * 1e3, qs)]


def scalar_metrics(run: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one run that a summary aggregates (throughputs, counts, latency stats, and the
    cpu_* costs that benchmarks.layers adds)."""
    keys = [k for k in run if k in SCALAR_KEYS or k.startswith("cpu_")
            or any(k.endswith(f"_{m}_ms") for m in LATENCY_METRICS + TTFT_PARTS)]
    return {k: float(run[k]) for k in keys if run[k] is not None}


def aggregate(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Median over runs of every scalar metric, with min and max as the spread."""
    if not runs:
        raise ValueError("no runs to aggregate")
    per_run = [scalar_metrics(r) for r in runs]
    keys = [k for k in per_run[0] if all(k in r for r in per_run)]
    return {
        "median": {k: statistics.median(r[k] for r in per_run) for k in keys},
        "min": {k: min(r[k] for r in per_run) for k in keys},
        "max": {k: max(r[k] for r in per_run) for k in keys},
    }
