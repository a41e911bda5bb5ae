"""benchmarks.group's probe and its per-step arithmetic (the timing run itself is not a test: it measures)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from benchmarks import group_probe
from benchmarks.group import _per_step
from model_service.distributed import lockstep, ops
from model_service.distributed.ops import Call, Op, Replica, codec_for
from tests.waiting import wait_until
from model_service.step_batch import empty_batch
from tests.distributed.fakes import FollowerEnd, LeaderEnd, RecordingEngine, Wire


def test_per_step_waits_count_only_the_window_and_the_blocked_kinds() -> None:
    records = [{"t": 0.5, "kind": "engine", "s": 9.0},  # before the window
               {"t": 1.0, "kind": "plan", "s": 0.002}, {"t": 1.1, "kind": "engine", "s": 0.001},
               {"t": 1.2, "kind": "results", "s": 0.010},
               {"t": 2.0, "kind": "plan", "s": 0.004}, {"t": 2.1, "kind": "engine", "s": 0.001},
               {"t": 2.2, "kind": "results", "s": 0.020}]
    out = _per_step(records, 1.0, 2.5, ("plan", "results"))
    assert out == {"steps": 2, "engine_ms": 1.0, "plan_ms": 3.0, "results_ms": 15.0, "wait_ms": 18.0}


class Recorded:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def add(self, kind: str, seconds: float) -> None:
        assert seconds >= 0
        self.kinds.append(kind)


def test_the_probe_times_a_followers_plans_dispatches_and_results_of_steps_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lockstep, "receive", lockstep.receive)  # restored after the test
    monkeypatch.setattr(ops.Replica, "run", ops.Replica.run)
    recorded = Recorded()
    group_probe.install(1, recorded)  # type: ignore[arg-type]
    engine, wire = RecordingEngine(), Wire()
    codec, replica = codec_for(engine), Replica(engine)
    batch = empty_batch(engine.max_rows, engine.max_samples, np.zeros((engine.slots, engine.table_len), np.int32))
    for seq, call in enumerate((Call(Op.INIT), Call(Op.STEP, batch=batch), Call(Op.NOOP))):
        lockstep.send(LeaderEnd(wire), codec, Call(call.op, seq, call.batch))
        result = replica.run(lockstep.receive(FollowerEnd(wire), codec))
        if call.op == Op.STEP:
            result[1].get()
    assert recorded.kinds == ["plan", "engine", "results"]


def test_the_probes_records_reach_its_file(tmp_path: pathlib.Path) -> None:
    records = group_probe.Records(tmp_path / "0.jsonl")
    records.add("plan", 0.25)
    wait_until(lambda: (tmp_path / "0.jsonl").read_text(), 5, message="the probe wrote no record")
    assert '"kind": "plan", "s": 0.25' in (tmp_path / "0.jsonl").read_text()


def test_the_probe_times_process_0s_plans_engine_calls_and_waits_for_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lockstep, "send", lockstep.send)  # restored after the test
    monkeypatch.setattr(lockstep.LockstepEngine, "step", lockstep.LockstepEngine.step)
    recorded = Recorded()
    group_probe.install(0, recorded)  # type: ignore[arg-type]
    inner = RecordingEngine()
    engine = lockstep.LockstepEngine(inner, LeaderEnd(Wire()), step_timeout=2.0, startup_timeout=5.0,
                                     keepalive_seconds=60.0, on_broken=lambda reason: None)
    engine.compile()
    batch = empty_batch(inner.max_rows, inner.max_samples, np.zeros((inner.slots, inner.table_len), np.int32))
    _, pending = engine.step(engine.init_state(), batch)
    pending.get()
    engine.close()
    assert recorded.kinds == ["plan", "engine", "results"]
