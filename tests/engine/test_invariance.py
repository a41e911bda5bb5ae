"""Batch invariance while requests join and leave mid-stream: on an engine that decodes 4 slots in tiles of 2
(so the number of tiles that run changes as requests come and go) and prefills prompts longer than 8 tokens in
chunks (decode steps of other requests run between them), every request's tokens and probabilities are
bit-identical to its solo run. Half of the requests use the sampling controls (top_k, min_p, penalties,
logit_bias), so their per-slot history and settings are covered too."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import dataclass, field

import jax.numpy as jnp
import pytest

from model_service.checkpoint import load_params
from model_service.config import MeshConfig, load_model_config
from model_service.engine import Engine
from model_service.model import GrokModel
from model_service.requests import Emission, GenerationRequest
from model_service.sampling_settings import GREEDY, SamplingSettings
from model_service.scheduler import Scheduler
from model_service.sharding import make_mesh
from tests.engine.conftest import Runner
from tests.procs import GOLDEN


@pytest.fixture(scope="module")
def tiled_engine() -> Engine:
    cfg = load_model_config(str(GOLDEN / "config.json"))
    mesh = make_mesh(MeshConfig(1, 1))
    params = load_params(str(GOLDEN / "checkpoint"), cfg, mesh, jnp.float32)
    # 8-token blocks and 16-token key chunks: steps read more chunks of keys as sequences grow
    model = GrokModel(cfg, mesh, jnp.float32, block_size=8, key_chunk=16)
    return Engine(model, params, cfg, mesh, 4, (32,), row_tile=2, prefill_chunk=8)


@dataclass
class Req:
    prompt: list[int]
    length: int
    seed: int
    temperature: float
    top_p: float
    blocked: tuple[int, ...] = ()
    controls: SamplingSettings = GREEDY  # its control fields
    out: list[tuple[int, float]] = field(default_factory=list)

    @property
    def sampling(self) -> SamplingSettings:
        return dataclasses.replace(self.controls, temperature=self.temperature, top_p=self.top_p,
                                   blocked=self.blocked)


CONTROLS = [
    GREEDY,
    SamplingSettings(top_k=20, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingSettings(min_p=0.05, presence_penalty=-0.5, logit_bias=((7, 3.0), (300, -20.0))),
    SamplingSettings(top_k=3, repetition_penalty=0.8),
]


def requests(n: int) -> list[Req]:
    rng = random.Random(5)
    return [Req([rng.randrange(3, 512) for _ in range(rng.randrange(2, 30))], rng.randrange(3, 14), 100 + i,
                [0.0, 0.8, 1.2][i % 3], [1.0, 0.9, 0.6][i % 3], tuple(rng.sample(range(3, 512), 40)) if i % 4 == 1 else (),
                CONTROLS[(i // 2) % len(CONTROLS)] if i % 2 else GREEDY)
            for i in range(n)]


def run(engine: Engine, reqs: list[Req], joins: list[int]) -> None:
    """Each request joins at step joins[i] into the lowest free slot (a long prompt one chunk per step) and
    leaves after its length."""
    state, owner, chunking, step = engine.init_decode_state(), {}, {}, 0
    waiting = sorted(range(len(reqs)), key=lambda i: joins[i])
    while waiting or owner or chunking:
        for slot, i in list(owner.items()):
            if len(reqs[i].out) >= reqs[i].length:
                state = engine.free_slot(state, slot)
                del owner[slot]
        while waiting and joins[waiting[0]] <= step and len(owner) + len(chunking) < engine.slots:
            i, r = waiting[0], reqs[waiting.pop(0)]
            slot = min(set(range(engine.slots)) - set(owner) - set(chunking))
            if engine.chunked(len(r.prompt)):
                chunking[slot] = (i, engine.begin_prefill(r.prompt, r.sampling, slot=slot, seed=r.seed))
                continue
            prefix, out = engine.prefill(r.prompt, r.sampling, seed=r.seed)
            r.out.append((int(out.token[0]), float(out.prob[0])))
            state = engine.insert(prefix, state, slot)
            owner[slot] = i
        for slot, (i, job) in list(chunking.items()):
            state, out = engine.prefill_next_chunk(job, state)
            if out is not None:
                reqs[i].out.append((int(out.token[0]), float(out.prob[0])))
                owner[slot] = i
                del chunking[slot]
        if owner:
            state, pending = engine.generate(state)
            out = pending.get()
            for slot, i in owner.items():
                if len(reqs[i].out) < reqs[i].length:
                    reqs[i].out.append((int(out.token[slot]), float(out.prob[slot])))
        step += 1


def test_requests_joining_and_leaving_mid_stream_equal_their_solo_runs(tiled_engine: Engine) -> None:
    solo = requests(9)
    for r in solo:
        run(tiled_engine, [r], [0])
    mixed = requests(9)
    run(tiled_engine, mixed, joins=[0, 0, 1, 3, 3, 4, 8, 9, 15])
    assert [r.out for r in mixed] == [r.out for r in solo]
    assert all(len(r.out) == r.length for r in mixed)


def test_scheduler_streams_arriving_at_random_times_equal_their_solo_runs(tiled_engine: Engine,
                                                                          running: Runner) -> None:
    reqs = requests(10)

    def submit(s: Scheduler, r: Req, done: threading.Event, out: list[tuple[int, float]]) -> None:
        def emit(e: Emission) -> None:
            out.extend((t.id, t.prob) for t in e.tokens)
            if e.finish_reason is not None or e.error is not None:
                done.set()
        s.submit(GenerationRequest("t", tuple(r.prompt), r.sampling, seed=r.seed, max_tokens=r.length,
                                   ignore_eos=True), emit)

    scheduler = running(tiled_engine, max_queue=16)
    solo = []
    for r in reqs:
        done, out = threading.Event(), []
        submit(scheduler, r, done, out)
        assert done.wait(60)
        solo.append(out)
    delays = random.Random(9).choices([0.0, 0.005, 0.02, 0.05, 0.1], k=len(reqs))
    events = [threading.Event() for _ in reqs]
    outs: list[list[tuple[int, float]]] = [[] for _ in reqs]

    def later(i: int) -> None:
        time.sleep(delays[i])
        submit(scheduler, reqs[i], events[i], outs[i])

    threads = [threading.Thread(target=later, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e.wait(120) for e in events)
    assert outs == solo
