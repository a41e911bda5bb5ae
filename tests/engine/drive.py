"""Driving a real Engine step by step without a scheduler, for tests that choose every row themselves.

`Driver` gives each slot a dense block table (slot i owns blocks i * blocks_per_sequence onward: the engine's
default pool) and builds StepBatches from plain lists: rows as (slot, position, token or None for the slot's
last draw), draws as (row, slot). `generate` runs one request alone, its prompt in chunks of any size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from model_service.engine import Engine
from model_service.engine_state import StepOutput
from model_service.sampling_settings import GREEDY, SamplingSettings
from model_service.step_batch import SlotStart, StepBatch

if TYPE_CHECKING:
    from model_service.requests import Emission, EmitFn, GenerationRequest
    from model_service.scheduler import Scheduler

Row = tuple[int, int, int | None]  # (slot, position, token; None: the slot's last draw)


@dataclass
class Drawn:
    tokens: list[int]
    probs: list[float]
    tops: list[np.ndarray]  # each draw's top-k probabilities


class Driver:
    def __init__(self, engine: Engine) -> None:
        if engine.num_blocks < engine.slots * engine.model.blocks_per_sequence:
            raise ValueError("Driver needs the engine's default pool (a full context per slot)")
        self.engine = engine
        self.tables = engine.model.dense_tables(engine.slots)
        self.state = engine.init_state()

    def step(self, rows: Sequence[Row], draws: Sequence[tuple[int, int]], starts: Sequence[SlotStart] = (),
             masks: Sequence[tuple[int, np.ndarray]] = (), score: Sequence[tuple[int, int]] = ()) -> StepOutput:
        """One step; `score` lists (row, next token) pairs to score."""
        e = self.engine
        r, p = e.max_rows, e.max_samples
        assert len(rows) <= r and len(draws) <= p
        tokens, from_last = np.zeros(r, np.int32), np.zeros(r, bool)
        positions, seq = np.zeros(r, np.int32), np.zeros(r, np.int32)
        for i, (slot, pos, tok) in enumerate(rows):
            seq[i], positions[i] = slot, pos
            if tok is None:
                from_last[i] = True
            else:
                tokens[i] = tok
        sample_rows, sample_slots = np.zeros(p, np.int32), np.full(p, e.slots, np.int32)
        for i, (row, slot) in enumerate(draws):
            sample_rows[i], sample_slots[i] = row, slot
        scored, targets = None, None
        if score:
            scored, targets = np.zeros(r, bool), np.zeros(r, np.int32)
            for row, target in score:
                scored[row], targets[row] = True, target
        batch = StepBatch(tokens, from_last, positions, seq, len(rows), self.tables, sample_rows, sample_slots,
                          scored, targets, tuple(starts), tuple(masks))
        self.state, pending = e.step(self.state, batch)
        return pending.get()


def generate(engine: Engine, prompt: Sequence[int], settings: SamplingSettings = GREEDY, seed: int = 0,
             max_tokens: int = 8, slot: int = 0, chunk: int | None = None, driver: Driver | None = None) -> Drawn:
    """One request alone in `slot`: its prompt `chunk` rows per step (default: as many as a step holds), then
    one decode row per step."""
    d = driver or Driver(engine)
    chunk = min(chunk or engine.max_rows, engine.max_rows)
    start = (SlotStart(slot, seed, settings, tuple(prompt)),)
    out = None
    for begin in range(0, len(prompt), chunk):
        part = list(range(begin, min(begin + chunk, len(prompt))))
        last = part[-1] == len(prompt) - 1
        out = d.step([(slot, p, int(prompt[p])) for p in part], [(len(part) - 1, slot)] if last else [],
                     start if begin == 0 else ())
    assert out is not None
    drawn = Drawn([int(out.token[0])], [float(out.prob[0])], [np.asarray(out.top_probs[0])])
    for i in range(max_tokens - 1):
        out = d.step([(slot, len(prompt) + i, None)], [(0, slot)])
        drawn.tokens.append(int(out.token[0]))
        drawn.probs.append(float(out.prob[0]))
        drawn.tops.append(np.asarray(out.top_probs[0]))
    return drawn


def serve_all(scheduler: "Scheduler", requests: Sequence["GenerationRequest"], timeout: float = 120.0) -> list[list[int]]:
    """Submit every request at once through a running scheduler; each one's token ids (sample 0's)."""
    import threading

    results: list[list[int]] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]

    def collector(i: int) -> "EmitFn":
        def emit(emission: "Emission") -> None:
            if emission.index == 0:
                results[i].extend(t.id for t in emission.tokens)
            if emission.error is not None:
                results[i].append(-1)
            if (emission.finish_reason is not None and emission.index == 0) or emission.error is not None:
                done[i].set()
        return emit

    for i, request in enumerate(requests):
        scheduler.submit(request, collector(i))
    assert all(event.wait(timeout) for event in done), "requests did not finish"
    return results
