"""The lockstep op table: calls survive the fixed-shape encoding exactly, and a Replica turns each op into
exactly one Engine call with those arguments."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from model_service.distributed.ops import HEADER_SIZE, Call, Codec, Op, Replica
from model_service.engine_api import EngineLike
from model_service.sampling_settings import SamplingSettings
from tests.distributed.fakes import RecordingEngine

CODEC = Codec(max_prompt=16, vocab_size=70)  # 70: the bitmaps' last word is partly used


def round_trip(call: Call) -> Call:
    payload = CODEC.payload(call) if CODEC.has_payload(call.op) else None
    return CODEC.decode(CODEC.header(call), payload)


def test_prefill_call_survives_encoding_with_float32_values_and_token_sets() -> None:
    call = Call(Op.PREFILL, seq=7, release_below=3, prefix=5, prompt=(1, 69, 0, 42), seed=2**32 - 1,
                sampling=SamplingSettings(temperature=0.7, top_p=0.95, allowed=(69, 3, 3, 0), blocked=(64, 31, 32),
                                          top_logprobs=6))
    back = round_trip(call)
    assert back.prompt == (1, 69, 0, 42) and back.seed == 2**32 - 1 and back.sampling.top_logprobs == 6
    assert (back.op, back.seq, back.release_below, back.prefix) == (Op.PREFILL, 7, 3, 5)
    assert back.sampling.temperature == float(np.float32(0.7)) and back.sampling.top_p == float(np.float32(0.95))
    assert back.sampling.allowed == (0, 3, 69) and back.sampling.blocked == (31, 32, 64)


def test_sampling_controls_survive_encoding_as_float32_values() -> None:
    controls = SamplingSettings(top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=-0.5,
                                frequency_penalty=1.9, logit_bias=((69, -100.0), (0, 0.3), (12, 7.25)))
    back = round_trip(Call(Op.BEGIN_PREFILL, prompt=(1, 2), sampling=controls)).sampling
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    assert back == SamplingSettings(top_k=40, min_p=f32(0.05), repetition_penalty=f32(1.1), presence_penalty=-0.5,
                                    frequency_penalty=f32(1.9), logit_bias=((69, -100.0), (0, f32(0.3)), (12, 7.25)))
    assert round_trip(Call(Op.PREFILL, prompt=(1,))).sampling == SamplingSettings()


def test_prompt_logprobs_survive_encoding_and_reach_the_engine() -> None:
    assert round_trip(Call(Op.PREFILL, prompt=(1,), prompt_logprobs=0)).prompt_logprobs == 0
    assert round_trip(Call(Op.PREFILL, prompt=(1,), prompt_logprobs=5)).prompt_logprobs == 5
    assert round_trip(Call(Op.PREFILL, prompt=(1,))).prompt_logprobs is None
    engine = RecordingEngine(slots=2, buckets=(8,), vocab_size=70)
    out = Replica(engine).run(Call(Op.PREFILL, prefix=1, prompt=(10, 11, 12), prompt_logprobs=2))
    assert ("prompt_logprobs", 2) in engine.calls and list(out.prompt.top_ids[:, 0]) == [11, 12]


def test_replica_passes_the_controls_to_the_engine() -> None:
    engine = RecordingEngine(slots=2, buckets=(8,), vocab_size=70)
    replica = Replica(engine)
    controls = SamplingSettings(top_k=3, logit_bias=((5, 1.0),))
    replica.run(Call(Op.PREFILL, prefix=1, prompt=(10,), sampling=controls))
    replica.run(Call(Op.BEGIN_PREFILL, prefix=2, slot=1, prompt=(10,), sampling=controls))
    assert [c for c in engine.calls if c[0] == "controls"] == [("controls", controls)] * 2


def test_replica_resamples_a_kept_prefix_into_a_new_id() -> None:
    engine = RecordingEngine(slots=2, buckets=(8,), vocab_size=70)
    replica = Replica(engine)
    replica.run(Call(Op.INIT))
    replica.run(Call(Op.PREFILL, prefix=3, prompt=(10, 11)))
    back = round_trip(Call(Op.RESAMPLE, prefix=4, source=3, seed=2))
    assert (back.op, back.prefix, back.source, back.seed) == (Op.RESAMPLE, 4, 3, 2)
    out = replica.run(back)
    assert int(out.token[0]) == 14 and replica.prefixes == {3: 12, 4: 14}  # the fake: first token + seed
    assert ("resample", 2) in engine.calls


def test_every_array_has_the_same_shape_whatever_the_call() -> None:
    short = Call(Op.PREFILL, prompt=(5,))
    full = Call(Op.PREFILL, prompt=tuple(range(16)), sampling=SamplingSettings(
        allowed=tuple(range(70)), top_k=2, logit_bias=tuple((i, 1.0) for i in range(70))))
    assert [a.shape for a in CODEC.payload(short)] == [a.shape for a in CODEC.payload(full)]
    assert [a.shape for a in CODEC.payload(short)] == [a.shape for a in CODEC.empty_payload()]
    for op in Op:
        assert CODEC.header(Call(op)).shape == (HEADER_SIZE,)
        assert CODEC.header(Call(op)).dtype == np.int32


def test_begin_prefill_call_survives_encoding_with_its_slot() -> None:
    sampling = SamplingSettings(temperature=0.5, top_p=0.9, blocked=(7,), top_logprobs=2)
    call = Call(Op.BEGIN_PREFILL, seq=8, prefix=6, slot=3, prompt=tuple(range(16)), seed=5, sampling=sampling)
    assert CODEC.has_payload(Op.BEGIN_PREFILL)
    assert round_trip(call) == dataclasses.replace(call, sampling=dataclasses.replace(
        sampling, temperature=float(np.float32(0.5)), top_p=float(np.float32(0.9))))


@pytest.mark.parametrize("op", [Op.INSERT, Op.FREE, Op.GENERATE, Op.INIT, Op.NOOP, Op.SHUTDOWN, Op.COMPILE_ALL,
                                Op.PREFILL_CHUNK])
def test_header_only_calls_survive_encoding(op: Op) -> None:
    call = Call(op, seq=123456, release_below=9, slot=6, prefix=11)
    assert not CODEC.has_payload(op)
    assert round_trip(call) == call


def test_a_prompt_longer_than_the_largest_bucket_cannot_be_encoded() -> None:
    with pytest.raises(ValueError, match="largest prefill bucket 16"):
        CODEC.payload(Call(Op.PREFILL, prompt=tuple(range(17))))


def test_replica_runs_each_op_as_one_engine_call_and_keeps_state_and_prefixes() -> None:
    engine = RecordingEngine(slots=2, buckets=(8, 16), vocab_size=70)
    replica = Replica(engine)
    replica.run(Call(Op.COMPILE_ALL))
    state = replica.run(Call(Op.INIT))
    out = replica.run(Call(Op.PREFILL, prefix=4, prompt=(10, 11), seed=9, sampling=SamplingSettings(
        temperature=0.5, top_p=0.9, allowed=(11, 12), blocked=(12,), top_logprobs=3)))
    assert int(out.token[0]) == 12
    state = replica.run(Call(Op.INSERT, prefix=4, slot=1))
    state, out = replica.run(Call(Op.GENERATE))
    assert int(out.get().token[1]) == 13 and state is replica.state
    replica.run(Call(Op.FREE, slot=1))
    assert engine.calls == [("compile_all",), ("init",), ("prefill_args", (10, 11), 9, 0.5, 0.9, (11, 12), (12,), 3),
                            ("prefill", (10, 11)), ("insert", 1), ("generate",), ("free", 1)]
    assert list(replica.prefixes) == [4]
    replica.run(Call(Op.NOOP, release_below=5))  # process 0 no longer holds prefix 4
    assert replica.prefixes == {}


def test_the_op_table_covers_every_engine_method_the_scheduler_uses() -> None:
    """A new Engine method the scheduler calls must get an op, or the followers would not run it."""
    methods = {name for name in vars(EngineLike) if not name.startswith("_") and callable(getattr(EngineLike, name))}
    covered = {"init_decode_state": Op.INIT, "prefill": Op.PREFILL, "insert": Op.INSERT, "generate": Op.GENERATE,
               "free_slot": Op.FREE, "begin_prefill": Op.BEGIN_PREFILL, "prefill_next_chunk": Op.PREFILL_CHUNK,
               "resample": Op.RESAMPLE}
    host_only = {"bucket_for", "chunked",  # pure functions of the configuration, the same on every process
                 # reads of the block tables, which every process keeps alike by running the same calls
                 "blocks_needed", "free_blocks", "blocks_short", "kv_usage"}
    assert methods == set(covered) | host_only


def test_replica_runs_a_chunked_prefill_job_kept_under_its_id_until_released() -> None:
    engine = RecordingEngine(slots=2, buckets=(8,), vocab_size=70, prefill_chunk=4)
    replica = Replica(engine)
    replica.run(Call(Op.INIT))
    assert replica.run(Call(Op.BEGIN_PREFILL, prefix=2, slot=1, prompt=tuple(range(10, 20)), seed=4,
                            sampling=SamplingSettings(temperature=0.5, top_logprobs=1))) is None
    outs = [replica.run(Call(Op.PREFILL_CHUNK, prefix=2))[1] for _ in range(3)]  # 10 tokens: chunks of 4, 4, 2
    assert outs[:2] == [None, None] and int(outs[2].token[0]) == 20 and int(replica.state.last[1]) == 20
    assert engine.calls[1] == ("begin_prefill_args", tuple(range(10, 20)), 1, 4, 0.5, 1.0, (), (), 1)
    assert [c for c in engine.calls if c[0] == "chunk"] == [("chunk", 1, 0), ("chunk", 1, 4), ("chunk", 1, 8)]
    replica.run(Call(Op.NOOP, release_below=3))
    assert replica.prefixes == {}
