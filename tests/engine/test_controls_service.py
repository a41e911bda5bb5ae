"""The sampling controls through the real golden engine and the model service's gRPC API: the first token of a
prefill against NumPy applied to the model's own logits, the token history the penalties read, stop_token_ids,
logit_bias, and validation naming the field."""

from __future__ import annotations

import dataclasses

import grpc
import jax.numpy as jnp
import numpy as np
import pytest

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.sampling import TOP_K
from model_service.sampling_settings import SamplingSettings
from model_service.engine import Engine
from tests.engine.conftest import collect
from tests.engine.drive import Driver, generate
from model_service.step_batch import SlotStart
from tests.engine.test_controls import np_distribution

PROMPT = [17, 40, 9, 40, 311, 17, 5, 88]


def model_logits(engine: Engine, prompt: list[int]) -> np.ndarray:
    """The network's logits after `prompt` ([V]), from a dense pass over it."""
    return np.asarray(engine.model.forward(engine.params, jnp.asarray([prompt], jnp.int32)), np.float32)[0, -1]


@pytest.mark.parametrize("controls", [
    SamplingSettings(repetition_penalty=3.0),
    SamplingSettings(repetition_penalty=0.3, logit_bias=((7, 4.0), (40, -3.0))),
    SamplingSettings(top_k=5, min_p=0.2),
], ids=["repetition", "bias+repetition", "top_k+min_p"])
def test_first_token_distribution_is_numpy_applied_to_the_models_logits(golden_engine: Engine,
                                                                         controls: SamplingSettings) -> None:
    v = golden_engine.vocab_size
    prompt_mask = np.zeros(v, bool)
    prompt_mask[PROMPT] = True
    mask = np.ones(v, bool)
    mask[golden_engine.pad_id] = False
    want = np_distribution(model_logits(golden_engine, PROMPT), controls, 0.9, 1.0, mask, prompt_mask,
                           np.zeros(v, np.int32))
    drawn = generate(golden_engine, PROMPT, dataclasses.replace(controls, temperature=0.9, top_logprobs=8), 3, 1)
    order = np.argsort(-want, kind="stable")[:TOP_K]  # the device computes TOP_K; a request reads its first 8
    np.testing.assert_allclose(drawn.tops[0], want[order], rtol=1e-4, atol=1e-6)
    assert want[drawn.tokens[0]] > 0


def test_history_counts_every_drawn_token_and_a_penalised_start_clears_it(golden_engine: Engine) -> None:
    """A slot's history (its prompt's ids, its draws' counts) is what its request's penalties read: kept while the
    request has penalties, replaced when the next request with penalties starts there. A start without penalties
    leaves the rows as they were (nothing reads them; writing them scattered every prompt id, one at a time on a
    TPU) and draws exactly what it draws in a fresh engine."""
    d = Driver(golden_engine)
    generated = generate(golden_engine, PROMPT, SamplingSettings(temperature=1.0, frequency_penalty=0.5), 1, 6,
                         slot=2, driver=d).tokens
    slots = d.state.slots
    counts = np.asarray(slots.history.counts)
    want = np.bincount(generated, minlength=golden_engine.vocab_size)
    assert np.array_equal(counts[2], want) and counts[[0, 1, 3]].sum() == 0
    assert np.flatnonzero(np.asarray(slots.history.prompt)[2]).tolist() == sorted(set(PROMPT))
    assert float(slots.controls.frequency[2]) == 0.5
    plain = SamplingSettings(temperature=1.0, top_logprobs=4)
    after = generate(golden_engine, [9, 10], plain, 5, 4, slot=2, driver=d)  # the slot's next request
    fresh = generate(golden_engine, [9, 10], plain, 5, 4, slot=2)
    assert after.tokens == fresh.tokens and after.probs == fresh.probs
    assert all(np.array_equal(a, b) for a, b in zip(after.tops, fresh.tops))
    slots = d.state.slots
    assert np.array_equal(np.asarray(slots.history.counts)[2], want)  # not written: not read
    assert float(slots.controls.frequency[2]) == 0.0
    again = generate(golden_engine, [9, 10], SamplingSettings(temperature=1.0, presence_penalty=0.1), 2, 3, slot=2,
                     driver=d).tokens
    slots = d.state.slots
    assert np.array_equal(np.asarray(slots.history.counts)[2], np.bincount(again, minlength=golden_engine.vocab_size))
    assert np.flatnonzero(np.asarray(slots.history.prompt)[2]).tolist() == [9, 10]


def test_a_repeated_token_is_penalised_by_the_counts_of_earlier_steps(golden_engine: Engine) -> None:
    """Greedy with a huge frequency penalty (and no presence of the prompt): a token generated once falls 2 logits
    per occurrence, so a greedy run whose plain version repeats a token must differ from it there."""
    plain = generate(golden_engine, PROMPT, SamplingSettings(), 0, 13).tokens
    penalised = generate(golden_engine, PROMPT, SamplingSettings(frequency_penalty=2.0, presence_penalty=2.0), 0,
                         13).tokens
    assert len(set(plain)) < len(plain), "the plain greedy run should repeat a token for this test to mean anything"
    assert len(set(penalised)) > len(set(plain))


def test_stop_token_ids_end_the_stream_with_the_token_included(golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    plain, _ = collect(golden_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=12,
                                                                      ignore_eos=True)))
    stop = plain[4]
    ids, replies = collect(golden_stub.Generate(model_pb2.GenerateRequest(
        token_ids=PROMPT, max_tokens=12, ignore_eos=True, stop_token_ids=[stop, 999 % 512])))
    assert ids == plain[:plain.index(stop) + 1]
    assert replies[-1].finish_reason == model_pb2.FINISH_REASON_STOP_TOKEN


def test_min_tokens_holds_back_eos_and_stop_token_ids_for_that_many_tokens(
        golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    eos = 2  # the golden config's
    plain, _ = collect(golden_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=12,
                                                                      ignore_eos=True)))
    stop = plain[1]
    held, replies = collect(golden_stub.Generate(model_pb2.GenerateRequest(
        token_ids=PROMPT, max_tokens=12, ignore_eos=True, stop_token_ids=[stop], min_tokens=4)))
    assert held[0] == plain[0] and stop not in held[:4] and held[1] != plain[1]
    assert (held[-1] == stop) == (replies[-1].finish_reason == model_pb2.FINISH_REASON_STOP_TOKEN)
    # EOS, which greedy takes at once here, comes as the 4th token; then the request ends
    ids, replies = collect(golden_stub.Generate(model_pb2.GenerateRequest(
        token_ids=PROMPT, max_tokens=10, allowed_token_ids=[77, eos], logit_bias={eos: 100.0}, min_tokens=3)))
    assert ids == [77, 77, 77, eos] and replies[-1].finish_reason == model_pb2.FINISH_REASON_EOS
    # nothing but EOS may be drawn: it is (never the pad token), and min_tokens cannot hold it back
    ids, replies = collect(golden_stub.Generate(model_pb2.GenerateRequest(
        token_ids=PROMPT, max_tokens=10, temperature=1.0, allowed_token_ids=[eos], min_tokens=5)))
    assert ids == [eos] and replies[-1].finish_reason == model_pb2.FINISH_REASON_EOS
    with pytest.raises(grpc.RpcError) as caught:
        list(golden_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=2, min_tokens=3), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("min_tokens:"), caught.value.details()


def test_logit_bias_of_100_makes_greedy_pick_that_token(golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    ids, _ = collect(golden_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=6, ignore_eos=True,
                                                                    logit_bias={123: 100.0})))
    assert ids == [123] * 6


@pytest.mark.parametrize(("fields", "field"), [
    ({"top_k": -5}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": -3.0}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": {600: 1.0}}, "logit_bias"), ({"logit_bias": {6: 101.0}}, "logit_bias"),
    ({"stop_token_ids": [512]}, "stop_token_ids"), ({"min_tokens": -1}, "min_tokens"),
])
def test_bad_controls_are_invalid_argument_naming_the_field(golden_stub: model_pb2_grpc.ModelServiceStub,
                                                            fields: dict, field: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(golden_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=2, **fields), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:"), caught.value.details()


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def test_prompt_logprobs_are_numpy_log_softmax_of_the_full_forward_pass(golden_engine: Engine) -> None:
    prompt = PROMPT + [3, 250, 17, 40]
    logits = np.asarray(golden_engine.model.forward(golden_engine.params, jnp.asarray([prompt], jnp.int32)))[0]
    want = np_log_softmax(logits)  # [n, V]: row t scores token t + 1
    n, start = len(prompt), SlotStart(0, 4, SamplingSettings(temperature=0.8), tuple(prompt))
    rows = [(0, p, t) for p, t in enumerate(prompt)]
    plain = Driver(golden_engine).step(rows, [(n - 1, 0)], [start])
    scored = Driver(golden_engine).step(rows, [(n - 1, 0)], [start], score=[(t, prompt[t + 1]) for t in range(n - 1)])
    assert plain.logprob is None and int(scored.token[0]) == int(plain.token[0])  # the first token is unchanged
    assert scored.logprob is not None and scored.score_logprobs is not None and scored.score_ids is not None
    np.testing.assert_allclose(scored.logprob[:n - 1], [want[t, prompt[t + 1]] for t in range(n - 1)], atol=2e-4)
    for t in range(n - 1):
        order = np.argsort(-want[t], kind="stable")[:TOP_K]
        np.testing.assert_allclose(scored.score_logprobs[t], want[t, order], atol=2e-4)
        assert int(scored.score_ids[t, 0]) == int(order[0])


def test_prompt_logprobs_over_grpc_score_every_prompt_token_but_the_first(
        golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    replies = list(golden_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=3, prompt_logprobs=2,
                                                                  ignore_eos=True), timeout=60))
    scored = [t for r in replies for t in r.prompt_logprobs]
    assert [t.id for t in scored] == PROMPT[1:] and len(replies[0].prompt_logprobs) == len(PROMPT) - 1
    assert all(len(t.top_tokens) == 2 and t.logprob <= 0 for t in scored)
    assert all(abs(np.exp(t.logprob) - t.probability) < 1e-6 for t in scored)
    with pytest.raises(grpc.RpcError) as caught:
        list(golden_stub.Generate(model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=1, prompt_logprobs=21)))
    assert caught.value.details().startswith("prompt_logprobs:")
