"""The lockstep messages: a step's whole batch survives the fixed-shape encoding exactly (rows, block tables,
draws, scores, starts with every sampling control, masks), and a Replica turns each op into exactly one Engine
call with those arguments."""

from __future__ import annotations

import numpy as np

from model_service.distributed.ops import HEADER_SIZE, Call, Codec, Op, Replica, codec_for
from model_service.sampling_settings import SamplingSettings
from model_service.step_batch import SlotStart, StepBatch, empty_batch
from tests.distributed.fakes import RecordingEngine, same_batch

ENGINE = RecordingEngine(slots=3, vocab_size=70, max_rows=8)  # 70: the bitmaps' last word is partly used
CODEC = codec_for(ENGINE)


def round_trip(call: Call) -> Call:
    header = CODEC.header(call)
    payload = CODEC.payload(call)
    assert [a.shape for a in payload] == CODEC.shapes(header)  # what a follower expects is what is sent
    assert header.shape == (HEADER_SIZE,) and all(a.dtype == np.int32 for a in payload)
    return CODEC.decode(header, payload)


def batch(**parts: object) -> StepBatch:
    tables = np.arange(3 * ENGINE.table_len, dtype=np.int32).reshape(3, -1)
    base = empty_batch(8, 3, tables)
    fields = dict(tokens=np.arange(8, dtype=np.int32) + 60, from_last=np.arange(8) % 2 == 0,
                  positions=np.arange(8, dtype=np.int32) * 3, seq=np.arange(8, dtype=np.int32) % 3, rows=6,
                  tables=tables, sample_rows=np.array([5, 1, 0], np.int32), sample_slots=np.array([2, 0, 3], np.int32))
    fields.update(parts)
    return StepBatch(**{**base.__dict__, **fields})  # type: ignore[arg-type]


def test_the_rows_tables_and_draws_of_a_step_survive_encoding() -> None:
    b = batch()
    back = round_trip(Call(Op.STEP, seq=7, batch=b))
    assert back.op == Op.STEP and back.seq == 7 and back.batch is not None and same_batch(back.batch, b)
    assert back.batch.score is None and back.batch.starts == () and back.batch.masks == ()


def test_scored_rows_survive_encoding() -> None:
    b = batch(score=np.arange(8) < 3, targets=np.arange(8, dtype=np.int32) + 1)
    back = round_trip(Call(Op.STEP, batch=b)).batch
    assert back is not None and np.array_equal(back.score, b.score) and np.array_equal(back.targets, b.targets)


def test_starts_survive_encoding_with_float32_values_token_sets_and_every_control() -> None:
    controls = SamplingSettings(temperature=0.7, top_p=0.95, allowed=(69, 3, 3, 0), blocked=(64, 31, 32),
                                top_logprobs=6, top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=-0.5,
                                frequency_penalty=1.9, logit_bias=((69, -100.0), (0, 0.3), (12, 7.25)),
                                min_tokens=9, ends=(2, 70, 5))
    starts = (SlotStart(2, 2**32 - 1, controls, (1, 69, 0, 42), (7, 8)), SlotStart(0, 5, SamplingSettings(), (9,)))
    back = round_trip(Call(Op.STEP, batch=batch(starts=starts))).batch
    assert back is not None
    s = back.starts[0]
    assert (s.slot, s.seed, s.prompt, s.drawn) == (2, 2**32 - 1, (1, 69, 0, 42), (7, 8))
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    assert s.settings == SamplingSettings(temperature=f32(0.7), top_p=f32(0.95), allowed=(0, 3, 69),
                                          blocked=(31, 32, 64), top_logprobs=6, top_k=40, min_p=f32(0.05),
                                          repetition_penalty=f32(1.1), presence_penalty=-0.5,
                                          frequency_penalty=f32(1.9),
                                          logit_bias=((69, -100.0), (0, f32(0.3)), (12, 7.25)),
                                          min_tokens=9, ends=(2, 70, 5))
    assert back.starts[1] == SlotStart(0, 5, SamplingSettings(), (9,))


def test_masks_survive_encoding() -> None:
    a, b = np.zeros(70, bool), np.ones(70, bool)
    a[[0, 33, 69]] = True
    b[31] = False
    back = round_trip(Call(Op.STEP, batch=batch(masks=((1, a), (2, b))))).batch
    assert back is not None and [m[0] for m in back.masks] == [1, 2]
    assert np.array_equal(back.masks[0][1], a) and np.array_equal(back.masks[1][1], b)


def test_calls_without_a_batch_are_a_header_alone() -> None:
    for op in (Op.NOOP, Op.SHUTDOWN, Op.COMPILE, Op.INIT):
        assert CODEC.payload(Call(op)) == () and CODEC.shapes(CODEC.header(Call(op))) == []
        assert round_trip(Call(op, seq=4)) == Call(op, seq=4)


def test_a_replica_runs_each_op_as_one_engine_call() -> None:
    engine = RecordingEngine(slots=3, vocab_size=70, max_rows=8)
    replica = Replica(engine)
    replica.run(Call(Op.COMPILE))
    state = replica.run(Call(Op.INIT))
    start = SlotStart(0, 1, SamplingSettings(), (10, 11))
    b = batch(tokens=np.array([10, 11, 0, 0, 0, 0, 0, 0], np.int32), from_last=np.zeros(8, bool),
              positions=np.array([0, 1, 0, 0, 0, 0, 0, 0], np.int32), seq=np.zeros(8, np.int32), rows=2,
              sample_rows=np.array([1, 0, 0], np.int32), sample_slots=np.array([0, 3, 3], np.int32), starts=(start,))
    new_state, pending = replica.run(Call(Op.STEP, batch=b))
    assert engine.compiles == 1 and len(engine.steps) == 1 and engine.steps[0] is b
    assert state is not new_state and replica.state is new_state and int(pending.get().token[0]) == 12


def test_a_codec_is_fixed_by_the_engine_configuration() -> None:
    codec = codec_for(ENGINE)
    assert isinstance(codec, Codec) and codec.rows == 8 and codec.slots == 3 and codec.vocab_size == 70
