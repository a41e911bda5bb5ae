"""The vectorised sampler (what accelerators run) before and after issue 61, at the Grok-1 vocabulary; print JSON.

    python -m benchmarks.sampler [--vocab 131072] [--draws 1,8,64] [--runs 20] [--cases greedy,sampled,...]
        [--candidates N]

"before" maps the per-draw sampler over the draws (`jax.vmap` of sampling._sample_active: every branch runs for
every draw, as sample_tokens(vectorised=True) did); "after" is sample_tokens(vectorised=True) now
(sampling_vectorised.py). Both are jitted alone, the engine's way (draws picked from slots by index, the controls
and history of every slot passed), and called alternately; each point reports the median milliseconds of each,
their ratio and whether the tokens of every call were equal. Cases:
  greedy     temperature 0, no alternatives, no control (the greedy step)
  sampled    temperature 0.8, top_p 0.95 on peaked logits (normal(0, 4): a nucleus of a few hundred ids)
  flat       temperature 1.0, top_p 0.95 on flat logits (normal(0, 0.5): the nucleus is most of the vocabulary)
  logprobs   greedy with 5 alternatives
  top_k      temperature 0.8, top_k 50, repetition_penalty 1.1
--candidates sets sampling_vectorised.CANDIDATES for "after" (the two-stage top-k's size: larger keeps more nuclei
off the search, at a larger top-k), to choose it on the chip. Runs on any platform (CPU in CI); on the TPU chip the
same command. Wall time: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model_service import sampling_vectorised
from model_service.logits_processing import Controls, History, idle_controls
from model_service.sampling import (
    SampleResult,
    SamplingParams,
    SlotControls,
    _idle_result,
    _sample_active,
    sample_tokens,
    seed_key,
    split_key,
)

CASES = ("greedy", "sampled", "flat", "logprobs", "top_k")


def mapped(keys: jax.Array, logits: jax.Array, params: SamplingParams, controls: Controls, history: History,
           index: jax.Array, used: jax.Array) -> SampleResult:
    """sample_tokens(vectorised=True) before issue 61: the per-draw sampler mapped over the draws."""
    v = logits.shape[-1]

    def one(i: jax.Array) -> SampleResult:
        j = index[i]
        c = jax.tree.map(lambda a: a[j], controls)
        extra = SlotControls(c, history, j, None, c.min_left > 0)
        return _sample_active(keys[i], logits[i], params.temperature[j], params.top_p[j], params.mask[j],
                              params.num_top[j], extra)

    return jax.vmap(lambda i: jax.lax.cond(used[i], one, lambda _: _idle_result(v), i))(jnp.arange(logits.shape[0]))


def batched(keys: jax.Array, logits: jax.Array, params: SamplingParams, controls: Controls, history: History,
            index: jax.Array, used: jax.Array) -> SampleResult:
    return sample_tokens(keys, logits.astype(jnp.float32), params, controls, history, index=index, used=used,
                         vectorised=True)


def inputs(case: str, draws: int, vocab: int, seed: int = 0) -> tuple[Any, ...]:
    """The sampler's arguments for `draws` draws of `case` (one slot per draw)."""
    rng = np.random.default_rng(seed)
    scale = 0.5 if case == "flat" else 4.0
    logits = jnp.asarray(rng.normal(0, scale, (draws, vocab)).astype(np.float32))
    keys = jnp.stack([split_key(seed_key(jnp.uint32(s)))[1] for s in range(draws)])
    temperature = {"greedy": 0.0, "logprobs": 0.0, "flat": 1.0}.get(case, 0.8)
    top_p = 0.95 if case in ("sampled", "flat") else 1.0
    num_top = 5 if case == "logprobs" else 0
    params = SamplingParams(jnp.full((draws,), temperature, jnp.float32), jnp.full((draws,), top_p, jnp.float32),
                            jnp.ones((draws, vocab), bool), jnp.ones((draws,), bool),
                            jnp.full((draws,), num_top, jnp.int32))
    controls = idle_controls(draws, vocab)
    if case == "top_k":
        controls = controls._replace(top_k=jnp.full((draws,), 50, jnp.int32),
                                     repetition=jnp.full((draws,), 1.1, jnp.float32))
    history = History(jnp.zeros((draws, vocab), bool), jnp.zeros((draws, vocab), jnp.int32))
    index = jnp.arange(draws, dtype=jnp.int32)
    return keys, logits, params, controls, history, index, jnp.ones((draws,), bool)


def point(case: str, draws: int, vocab: int, runs: int) -> dict[str, Any]:
    args = inputs(case, draws, vocab)
    forms = {"before": jax.jit(mapped), "after": jax.jit(batched)}
    compile_s, times, tokens = {}, {name: [] for name in forms}, {}
    for name, fn in forms.items():
        start = time.perf_counter()
        tokens[name] = np.asarray(jax.block_until_ready(fn(*args)).token)
        compile_s[name] = round(time.perf_counter() - start, 2)
    for _ in range(runs):
        for name, fn in forms.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - start) * 1e3)
    before, after = (statistics.median(times[n]) for n in ("before", "after"))
    return {"case": case, "draws": draws, "vocab": vocab, "before_ms": round(before, 3), "after_ms": round(after, 3),
            "speedup": round(before / after, 2), "first_call_s": compile_s,
            "tokens_equal": bool(np.array_equal(tokens["before"], tokens["after"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--draws", default="1,8,64")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--candidates", type=int, default=sampling_vectorised.CANDIDATES)
    a = parser.parse_args()
    if a.candidates < 1:
        parser.error(f"--candidates must be at least 1, got {a.candidates}")
    sampling_vectorised.CANDIDATES = a.candidates  # read when "after" is traced
    cases = a.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    points = [point(c, int(d), a.vocab, a.runs) for d in a.draws.split(",") for c in cases]
    print(json.dumps({"platform": jax.devices()[0].platform, "device": str(jax.devices()[0].device_kind),
                      "jax": jax.__version__, "load": os.getloadavg()[0], "candidates": a.candidates,
                      "points": points}, indent=1))


if __name__ == "__main__":
    main()
