"""Batch invariance by construction: a row's logits are the same bits whatever else shares its step, wherever
it lands in the step's tiles, however its prompt was split over steps, and whether its prefix came from the
cache. On golden (4 slots, tiles of 4 rows, steps of 16 rows: several tiles per step) and golden_wide, requests
join and leave at random steps, each prompt split into random chunks beside other requests' rows in random
order; every request's tokens, probabilities and alternatives are bit-identical to its solo run (its whole
prompt in one step). Half of the requests use the sampling controls (top_k, min_p, penalties, logit_bias), so
their per-slot history and settings are covered too."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax.numpy as jnp
import pytest

from model_service.checkpoint import load_params
from model_service.config import MeshConfig, load_model_config
from model_service.engine import Engine
from model_service.engine_state import StepOutput
from model_service import kernels
from model_service.model import GrokModel, Products
from model_service.requests import Emission, GenerationRequest
from model_service.sampling_settings import GREEDY, SamplingSettings
from model_service.scheduler import Scheduler
from model_service.sharding import make_mesh
from model_service.step_batch import SlotStart
from tests.engine.conftest import Runner
from tests.engine.drive import Driver, Row
from tests.procs import GOLDEN, SHARED


def tiled(config_dir: Path, vocab: int, products: Products | None = None) -> Engine:
    cfg = load_model_config(str(config_dir / "config.json"))
    mesh = make_mesh(MeshConfig(1, 1))
    # 8-token blocks and 16-token key chunks: rows read more chunks of keys as sequences grow
    model = GrokModel(cfg, mesh, jnp.float32, products, block_size=8, key_chunk=16)
    params = load_params(str(config_dir / "checkpoint"), cfg, mesh, jnp.float32, pack=model.products.native,
                         int8_table=model.products.int8)
    return Engine(model, params, cfg, mesh, 4, step_tokens=16, tile=4)


@pytest.fixture(scope="module")
def tiled_engine() -> Engine:
    return tiled(GOLDEN, 512)


@pytest.fixture(scope="module")
def wide_tiled_engine() -> Engine:
    return tiled(SHARED / "golden_wide", 131072)


@dataclass
class Req:
    prompt: list[int]
    length: int
    seed: int
    temperature: float
    top_p: float
    blocked: tuple[int, ...] = ()
    controls: SamplingSettings = GREEDY  # its control fields
    out: list[tuple[int, float, tuple[float, ...]]] = field(default_factory=list)

    @property
    def sampling(self) -> SamplingSettings:
        return dataclasses.replace(self.controls, temperature=self.temperature, top_p=self.top_p,
                                   blocked=self.blocked)


CONTROLS = [
    SamplingSettings(top_logprobs=8),
    SamplingSettings(top_k=20, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingSettings(min_p=0.05, presence_penalty=-0.5, logit_bias=((7, 3.0), (300, -20.0))),
    SamplingSettings(top_k=3, repetition_penalty=0.8),
]


def requests(n: int, vocab: int = 512) -> list[Req]:
    rng = random.Random(5)
    return [Req([rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))], rng.randrange(3, 14), 100 + i,
                [0.0, 0.8, 1.2][i % 3], [1.0, 0.9, 0.6][i % 3],
                tuple(rng.sample(range(3, vocab), 40)) if i % 4 == 1 else (),
                CONTROLS[(i // 2) % len(CONTROLS)] if i % 2 else GREEDY)
            for i in range(n)]


def token(out: StepOutput, entry: int) -> tuple[int, float, tuple[float, ...]]:
    return int(out.token[entry]), float(out.prob[entry]), tuple(float(p) for p in out.top_probs[entry])


def run(engine: Engine, reqs: list[Req], joins: list[int], rng: random.Random | None) -> None:
    """Each request joins at step joins[i] into the lowest free slot and leaves after its length. With `rng`,
    each step computes a random number of each prompt's next rows (at least one), the requests' rows in random
    order; without, a prompt is computed whole in one step."""
    d = Driver(engine)
    owner: dict[int, int] = {}  # slot -> request
    done: dict[int, int] = {}  # slot -> positions computed
    waiting = sorted(range(len(reqs)), key=lambda i: joins[i])
    step = 0
    while waiting or owner:
        for slot, i in list(owner.items()):
            if len(reqs[i].out) >= reqs[i].length:
                del owner[slot]
        starts = []
        while waiting and joins[waiting[0]] <= step and len(owner) < engine.slots:
            i = waiting.pop(0)
            slot = min(set(range(engine.slots)) - set(owner))
            owner[slot], done[slot] = i, 0
            r = reqs[i]
            starts.append(SlotStart(slot, r.seed, r.sampling, tuple(r.prompt)))
        order = list(owner.items())
        if rng is not None:
            rng.shuffle(order)
        rows: list[Row] = []
        draws: list[tuple[int, int]] = []
        for slot, i in order:
            r = reqs[i]
            n = len(r.prompt)
            if done[slot] < n:  # prompt rows
                room = engine.max_rows - len(rows) - (len(order) - 1)  # leave a row for everyone else
                take = n - done[slot] if rng is None else rng.randint(1, max(1, min(n - done[slot], room)))
                take = min(take, engine.max_rows - len(rows))
                rows += [(slot, p, r.prompt[p]) for p in range(done[slot], done[slot] + take)]
                done[slot] += take
                if done[slot] == n:
                    draws.append((len(rows) - 1, slot))
            elif len(rows) < engine.max_rows:  # a decode row: the slot's last draw at its next position
                rows.append((slot, n + len(r.out) - 1, None))
                draws.append((len(rows) - 1, slot))
        if rows:
            out = d.step(rows, draws, starts)
            for entry, (_, slot) in enumerate(draws):
                reqs[owner[slot]].out.append(token(out, entry))
        step += 1


@pytest.mark.parametrize("seed", [0, 1])
def test_requests_split_and_mixed_at_random_equal_their_solo_runs(tiled_engine: Engine, seed: int) -> None:
    solo = requests(9)
    for r in solo:
        run(tiled_engine, [r], [0], None)
    mixed = requests(9)
    run(tiled_engine, mixed, joins=[0, 0, 1, 3, 3, 4, 8, 9, 15], rng=random.Random(seed))
    assert [r.out for r in mixed] == [r.out for r in solo]
    assert all(len(r.out) == r.length for r in mixed)


@pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
def test_with_int8_activations_requests_split_and_mixed_at_random_equal_their_solo_runs() -> None:
    """The opt-in int8 rounding of the rows (--products native-int8) is per row too: invariance holds."""
    engine = tiled(GOLDEN, 512, Products.NATIVE_INT8)
    solo = requests(9)
    for r in solo:
        run(engine, [r], [0], None)
    mixed = requests(9)
    run(engine, mixed, joins=[0, 0, 1, 3, 3, 4, 8, 9, 15], rng=random.Random(2))
    assert [r.out for r in mixed] == [r.out for r in solo]


def test_wide_requests_split_and_mixed_at_random_equal_their_solo_runs(wide_tiled_engine: Engine) -> None:
    solo = requests(5, 131072)
    for r in solo:
        run(wide_tiled_engine, [r], [0], None)
    mixed = requests(5, 131072)
    run(wide_tiled_engine, mixed, joins=[0, 0, 1, 2, 4], rng=random.Random(7))
    assert [r.out for r in mixed] == [r.out for r in solo]


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
