"""Paged KV memory through the scheduler on the golden checkpoints: the prefix cache gives the bits recomputing
gives, a preempted request ends exactly as it would have alone, admission waits for blocks, a long neighbour
moving every step to a longer context changes no other request, and every block comes back."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from model_service.engine import Engine
from model_service.loading import build_engine, resolve
from model_service.loop_state import SchedulerMetrics
from model_service.requests import Emission, GenerationRequest
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from tests.engine.conftest import Runner, golden_requests, golden_server_config
from tests.engine.test_golden_wide import CASES as WIDE_CASES, WIDE
from tests.waiting import wait_until


def paged_engine(**overrides: Any) -> Engine:
    """The golden engine with 8-token blocks, so the golden prompts (8-29 tokens) share cached blocks."""
    config = golden_server_config(**{"slots": 4, "block_size": 8, **overrides})
    return build_engine(config, resolve(config))


@pytest.fixture(scope="module")
def cached() -> Engine:
    return paged_engine()


@pytest.fixture(scope="module")
def small(cached: Engine) -> Engine:
    """The golden weights with 16-token key chunks (a step reads 1 to 8 chunks as its longest sequence needs) and
    a pool of 256 tokens: two full contexts."""
    from model_service.model import GrokModel

    m = cached.model
    model = GrokModel(m.cfg, m.mesh, m.dtype, m.products, block_size=8, key_chunk=16)
    return Engine(model, cached.params, m.cfg, cached.mesh, 4, kv_blocks=32)


@dataclass
class Result:
    tokens: list[tuple[int, float]] = field(default_factory=list)
    finish: Any = None
    error: Any = None
    done: threading.Event = field(default_factory=threading.Event)


class Counting(SchedulerMetrics):
    def __init__(self) -> None:
        self.preemptions = 0
        self.usage: Any = None

    def preempted(self) -> None:
        self.preemptions += 1

    def observe_kv(self, usage: Any) -> None:
        self.usage = usage


def submit(scheduler: Scheduler, prompt: list[int], seed: int, max_tokens: int, temperature: float = 0.8,
           top_p: float = 0.95, **settings: Any) -> Result:
    result = Result()

    def emit(e: Emission) -> None:
        result.tokens.extend((t.id, t.prob) for t in e.tokens)
        if e.error is not None or e.finish_reason is not None:
            result.error, result.finish = e.error, e.finish_reason
            result.done.set()

    stops = settings.pop("stop_token_ids", ())
    scheduler.submit(GenerationRequest("t", tuple(prompt), SamplingSettings(temperature=temperature, top_p=top_p,
                                                                            **settings),
                                       seed=seed, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stops), emit)
    return result


def one_by_one(scheduler: Scheduler, prompts: list[list[int]], max_tokens: int = 12,
               **settings: Any) -> list[list[tuple[int, float]]]:
    out = []
    for i, prompt in enumerate(prompts):
        r = submit(scheduler, prompt, seed=40 + i, max_tokens=max_tokens, **settings)
        assert r.done.wait(120) and r.error is None, r.error
        out.append(r.tokens)
    return out


def shared_prefix_prompts(base: list[int], vocab: int, rng: random.Random) -> list[list[int]]:
    """The prompt, the prompt with three different continuations (a system prompt, a few-shot header, a chat's
    earlier turns), and the prompt again."""
    tails = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    return [base] + [base + tail for tail in tails] + [base]


def test_golden_prompts_with_the_cache_on_and_off_give_identical_seeded_outputs(cached: Engine,
                                                                                running: Runner) -> None:
    rng = random.Random(3)
    prompts = [p for case in golden_requests() for p in shared_prefix_prompts(case["prompt_ids"], 512, rng)]
    on = running(cached)
    with_cache = one_by_one(on, prompts)
    wait_until(lambda: on.kv.usage().used == 0)
    usage = on.kv.usage()
    assert usage.hits > 0.4 * usage.queries  # most of each prompt after its first run came from the cache
    on.stop()
    off = running(cached, prefix_caching=False)
    assert one_by_one(off, prompts) == with_cache
    assert off.kv.usage().hits == 0


def test_golden_requests_reproduce_the_reference_when_their_prompt_is_cached(cached: Engine, running: Runner) -> None:
    scheduler = running(cached)
    for case in golden_requests():
        q = case["request"]
        for _ in range(2):  # computed, then served from the cache
            r = submit(scheduler, case["prompt_ids"], q["rng_seed"], q["max_len"], q["temperature"], q["nucleus_p"])
            assert r.done.wait(120) and r.error is None
            assert [t for t, _ in r.tokens] == case["output_ids"]


def test_golden_wide_prompts_with_the_cache_on_and_off_give_identical_seeded_outputs(running: Runner) -> None:
    config = golden_server_config(config=str(WIDE / "config.json"), checkpoint=str(WIDE / "checkpoint"),
                                  slots=2, block_size=4)
    engine = build_engine(config, resolve(config))
    rng = random.Random(4)
    prompts = [p for case in WIDE_CASES for p in shared_prefix_prompts(case["prompt_ids"], 131072, rng)][:10]
    on = running(engine)
    with_cache = one_by_one(on, prompts, 8)
    assert on.kv.usage().hits > 0
    on.stop()
    assert one_by_one(running(engine, prefix_caching=False), prompts, 8) == with_cache


def test_preempted_requests_end_exactly_as_they_would_alone(small: Engine, running: Runner) -> None:
    """A pool of 256 tokens for four requests that grow to 85-110 tokens each: admission waits for blocks,
    running requests are preempted and recomputed, and every request's tokens equal its solo run. Each has a stop
    token it favours, held back by min_tokens: a sample resumed after k draws holds it back for the draws left."""
    engine = small
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 45))] for _ in range(4)]
    stop = 77
    held = {"stop_token_ids": (stop,), "logit_bias": ((stop, 4.0),), "min_tokens": 50}
    metrics = Counting()
    scheduler = running(engine, metrics=metrics)
    solo = one_by_one(scheduler, prompts, max_tokens=65, **held)
    together = [submit(scheduler, p, seed=40 + i, max_tokens=65, **held) for i, p in enumerate(prompts)]
    for r in together:
        assert r.done.wait(300) and r.error is None, r.error
    assert metrics.preemptions > 0
    assert [r.tokens for r in together] == solo
    assert all(stop not in [t for t, _ in tokens[:50]] for tokens in solo)
    wait_until(lambda: scheduler.kv.usage().used == 0)


def test_a_cancelled_request_gives_its_blocks_back(cached: Engine, running: Runner) -> None:
    scheduler = running(cached)
    started = threading.Event()
    handle = scheduler.submit(GenerationRequest("t", tuple(range(5, 45)), SamplingSettings(), max_tokens=80,
                                                ignore_eos=True), lambda e: started.set())
    assert started.wait(60)
    assert scheduler.kv.usage().used > 0
    handle.cancel()
    wait_until(lambda: scheduler.kv.usage().used == 0 and scheduler.stats()["active"] == 0, timeout=60)


def test_a_long_neighbour_moving_to_longer_contexts_changes_no_other_request(small: Engine, running: Runner) -> None:
    """16-token key chunks: a step reads as many chunks as its longest sequence fills (1 to 8)."""
    scheduler = running(small)
    short, long_ = list(range(40, 50)), [random.Random(8).randrange(3, 512) for _ in range(60)]
    alone = one_by_one(scheduler, [short], max_tokens=40)[0]
    a = submit(scheduler, short, seed=40, max_tokens=40)
    b = submit(scheduler, long_, seed=41, max_tokens=60)
    for r in (a, b):
        assert r.done.wait(120) and r.error is None
    assert a.tokens == alone


def test_the_kv_metrics_follow_requests_that_end(cached: Engine, running: Runner) -> None:
    metrics = Counting()
    scheduler = running(cached, metrics=metrics)
    r = submit(scheduler, list(range(20, 50)), seed=1, max_tokens=5)
    assert r.done.wait(60) and r.error is None
    wait_until(lambda: metrics.usage is not None and metrics.usage.used == 0, timeout=10,
               message=lambda: f"the last KV usage reported: {metrics.usage}")


def test_two_samples_of_a_long_prompt_fit_a_pool_that_holds_their_shared_blocks_once(running: Runner) -> None:
    """A 100-token prompt with n = 2 on a pool of 8 blocks of 16 (one full context of 128 tokens): each sample
    holds 7 blocks, 6 of them shared, so 8 suffice (counting the shared blocks twice would refuse it)."""
    engine = paged_engine(block_size=16, kv_tokens=128, slots=2)
    scheduler = running(engine)
    done = threading.Event()
    ends: list[Any] = []

    def emit(e: Emission) -> None:
        if e.finish_reason is not None or e.error is not None:
            ends.append(e.error or e.finish_reason)
            if len(ends) == 2 or e.error is not None:
                done.set()

    scheduler.submit(GenerationRequest("t", tuple(range(3, 103)), SamplingSettings(temperature=1.0), n=2, seed=1,
                                       max_tokens=3, ignore_eos=True), emit)
    assert done.wait(60) and all(not isinstance(e, Exception) for e in ends), ends


def test_preempted_samples_of_one_prompt_resume_sharing_its_blocks_and_draw_what_they_drew_alone(
        small: Engine, running: Runner) -> None:
    """Three n = 2 requests growing to ~100 tokens on the 256-token pool: preempted samples resume with the
    prompt's blocks computed once by the first unfinished sample (issue 64.2), and draw exactly their solo tokens."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(30, 45))] for _ in range(3)]
    metrics = Counting()
    scheduler = running(small, metrics=metrics)

    def both(prompt: list[int], seed: int) -> tuple[threading.Event, dict[int, list[tuple[int, float]]], list[Any]]:
        done, tokens, ends = threading.Event(), {0: [], 1: []}, []

        def emit(e: Emission) -> None:
            tokens[e.index].extend((t.id, t.prob) for t in e.tokens)
            if e.error is not None or e.finish_reason is not None:
                ends.append(e.error or e.finish_reason)
                if len(ends) == 2 or e.error is not None:
                    done.set()

        scheduler.submit(GenerationRequest("t", tuple(prompt), SamplingSettings(temperature=0.8, top_p=0.95), n=2,
                                           seed=seed, max_tokens=60, ignore_eos=True), emit)
        return done, tokens, ends

    solo = []
    for i, p in enumerate(prompts):
        done, tokens, ends = both(p, 50 + i)
        assert done.wait(300) and not any(isinstance(e, Exception) for e in ends), ends
        solo.append(tokens)
    together = [both(p, 50 + i) for i, p in enumerate(prompts)]
    for done, _, ends in together:
        assert done.wait(300) and not any(isinstance(e, Exception) for e in ends), ends
    assert metrics.preemptions > 0
    assert [tokens for _, tokens, _ in together] == solo
    wait_until(lambda: scheduler.kv.usage().used == 0)
