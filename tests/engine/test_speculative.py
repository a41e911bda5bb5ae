"""Speculative decoding changes no token: n-gram drafts verified in one step give every request exactly the
tokens, probabilities and alternatives it gets without them (greedy and seeded, every control, n > 1, stop ids,
max_tokens), in fewer steps when the drafts are right; the policy is tested on the fake engine, exactness on
the golden, golden_wide and demo checkpoints with the same engine serving with and without speculation."""

from __future__ import annotations

import dataclasses
import random
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from model_service.engine import Engine
from model_service.loop_state import SchedulerMetrics
from model_service.loading import build_engine, resolve
from model_service.requests import Emission, GenerationRequest
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from model_service.speculative import DraftPacer, SpeculativeConfig, parse_speculative_config, propose
from tests.engine.conftest import Runner, golden_requests, golden_server_config
from tests.engine.fake_engine import FakeEngine
from tests.engine.test_scheduler import Collector, req
from tests.procs import ROOT

SPEC = SpeculativeConfig("ngram", 4, 3, 1)


def test_a_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 1) == [7, 1]  # the latest "1 2 3" is followed by 7
    assert propose([5, 6, 7, 5, 6], 4, 3, 1) == [7, 5, 6]  # "5 6" at 0: what follows, up to the end
    assert propose([1, 2, 3, 4], 3, 3, 1) == []  # nothing repeats
    assert propose([4, 8, 4], 3, 3, 2) == []  # a one-token suffix is below prompt_lookup_min
    assert propose([4, 8, 4], 3, 3, 1) == [8, 4]


@pytest.mark.parametrize("raw, message", [
    ("{", "not JSON"), ("[]", "JSON object"), ('{"method": "eagle", "num_speculative_tokens": 2}', "not served"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"), ('{"num_speculative_tokens": 2, "x": 1}', "unknown"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "must not exceed")])
def test_a_bad_speculative_config_is_refused_naming_the_problem(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(raw)


def test_the_config_takes_vllms_shape() -> None:
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}') == \
        SpeculativeConfig("ngram", 4, 3, 1)
    assert parse_speculative_config(None) is None


def test_a_sample_whose_drafts_keep_failing_stops_drafting_for_longer_each_time() -> None:
    pacer = DraftPacer()
    pacer.verified(4, 0)
    assert pacer.ready()  # one failure: try again at once
    pacer.verified(4, 0)
    assert [pacer.ready() for _ in range(3)] == [False, False, True]  # two in a row: skip two steps
    pacer.verified(4, 3)
    assert pacer.ready() and pacer.rate == 3 / 12


def test_a_sample_whose_lookups_find_nothing_looks_for_drafts_less_often() -> None:
    pacer = DraftPacer()
    pacer.looked_up(False)
    assert pacer.due() and pacer.ready()  # one miss: look again at once
    pacer.looked_up(False)
    assert not pacer.due() and [pacer.ready() for _ in range(3)] == [False, False, True]  # two: skip two steps
    for _ in range(20):
        pacer.looked_up(False)
    assert pacer.wait == DraftPacer.MAX_WAIT
    pacer.looked_up(True)
    pacer.wait = 0
    pacer.looked_up(False)
    assert pacer.due()  # a lookup that found drafts reset the count


def test_the_loop_waits_for_the_step_in_flight_only_when_a_sample_looks_for_drafts(running: Runner) -> None:
    """Drafts follow the newest token, so a step that looks for drafts waits for the previous step's draws
    instead of overlapping with it; counting up repeats nothing, so the lookups back off and most steps overlap
    (without the pacing every one of the 64 steps waited)."""
    engine, out = spec_fake(sequence_len=128, vocab_size=256), Collector()
    scheduler = running(engine, speculative=SPEC, start=False)
    due = scheduler.builder.drafts_due
    waits: list[bool] = []
    scheduler.builder.drafts_due = lambda runs: waits.append(due(runs)) or waits[-1]  # type: ignore[method-assign]
    scheduler.start()
    scheduler.submit(req(tuple(range(10, 20)), max_tokens=64), out)
    assert out.wait().ids == list(range(20, 84))
    assert 0 < sum(waits) <= 10, f"the loop waited on {sum(waits)} of {len(waits)} steps"


def spec_fake(**kw: Any) -> FakeEngine:
    return FakeEngine(slots=2, max_rows=16, draft_tokens=SPEC.num_speculative_tokens, **kw)


def test_right_drafts_give_the_same_tokens_in_fewer_steps_several_per_message(running: Runner) -> None:
    """The fake draws t + 1 after t; a prompt counting up twice makes every lookup right."""
    prompt = tuple(range(10, 20)) + tuple(range(10, 14))
    plain_engine, spec_engine = spec_fake(), spec_fake()
    plain, spec = Collector(), Collector()
    running(plain_engine).submit(req(prompt, max_tokens=6), plain)
    running(spec_engine, speculative=SPEC).submit(req(prompt, max_tokens=6), spec)
    assert spec.wait().ids == plain.wait().ids == list(range(14, 20))
    # the prompt's step draws 14; one verification then takes 15..19: 4 drafts and the draw after them
    assert len(plain_engine.steps) == 6 and len(spec_engine.steps) == 2
    assert [len(e.tokens) for e in spec.emissions] == [1, 5]
    assert spec.last.completion_tokens == 6  # never one token more than max_tokens
    assert spec.last.timings is not None and spec.last.timings.accepted_draft_tokens > 0


def test_a_prompt_whose_last_row_is_computed_alone_gets_no_drafts_on_that_row(running: Runner) -> None:
    """A 17-token prompt on 16-row steps computes its last prompt row alone in the second step: that row draws
    the first token and is no decode row, so no drafts ride on it (they once read the prompt's last token again
    and emitted the first token twice)."""
    prompt = tuple(range(10, 20)) + tuple(range(10, 17))  # the lookup's drafts at the end: 17, 18, 19, 10
    spec = Collector()
    running(spec_fake(), speculative=SPEC).submit(req(prompt, max_tokens=6), spec)
    assert spec.wait().ids == list(range(17, 23))
    assert spec.last.timings.accepted_draft_tokens > 0  # drafts ride on the decode rows after it


def test_a_service_whose_slots_are_all_busy_still_drafts_when_nothing_waits(running: Runner) -> None:
    """One request on a one-slot service (every slot busy, no request queued) is what speculation is for."""
    prompt = tuple(range(10, 20)) + tuple(range(10, 14))
    engine, spec = FakeEngine(slots=1, max_rows=16, draft_tokens=SPEC.num_speculative_tokens), Collector()
    running(engine, speculative=SPEC).submit(req(prompt, max_tokens=6), spec)
    assert spec.wait().ids == list(range(14, 20))
    assert len(engine.steps) == 2 and spec.last.timings.accepted_draft_tokens == 4


def test_a_stop_id_inside_accepted_drafts_ends_the_request_there(running: Runner) -> None:
    prompt = tuple(range(20, 30)) + tuple(range(20, 23))
    spec = Collector()
    running(spec_fake(), speculative=SPEC).submit(req(prompt, max_tokens=12, stop_token_ids=(25,)), spec)
    assert spec.wait().ids == [23, 24, 25] and [len(e.tokens) for e in spec.emissions] == [1, 2]


def test_wrong_drafts_change_nothing(running: Runner) -> None:
    """A prompt that repeats a token with different followers: lookups propose what is not drawn."""
    prompt = (30, 7, 30, 9, 30, 11, 30)
    plain, spec = Collector(), Collector()
    running(spec_fake()).submit(req(prompt, max_tokens=8), plain)
    engine = spec_fake()
    running(engine, speculative=SPEC).submit(req(prompt, max_tokens=8), spec)
    assert spec.wait().ids == plain.wait().ids == list(range(31, 39))


@dataclass
class Out:
    tokens: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    messages: int = 0
    done: threading.Event = field(default_factory=threading.Event)


def serve(scheduler: Scheduler, requests: list[GenerationRequest]) -> list[dict[int, Out]]:
    outs: list[dict[int, Out]] = [{i: Out() for i in range(r.n)} for r in requests]

    def collector(k: int) -> Any:
        def emit(e: Emission) -> None:
            o = outs[k][e.index]
            o.tokens.extend((t.id, t.prob, t.top) for t in e.tokens)
            o.messages += 1
            if e.finish_reason is not None or e.error is not None:
                assert e.error is None, e.error
                o.done.set()
        return emit

    for k, r in enumerate(requests):
        scheduler.submit(r, collector(k))
    assert all(o.done.wait(180) for out in outs for o in out.values())
    return outs


def repetitive(rng: random.Random, vocab: int, n: int) -> tuple[int, ...]:
    """A prompt that repeats a phrase, so that lookups find drafts."""
    phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 7))]
    return tuple((phrase * 8)[:n])


def requests(vocab: int) -> list[GenerationRequest]:
    """Greedy and sampled requests with every kind of control. The first four favour three tokens with a
    logit_bias (the random golden weights write nothing predictable otherwise), so that drafts are accepted as
    well as rejected; the fourth's stop token is one of them, held back by min_tokens (drafts of it too)."""
    rng = random.Random(11)
    controls = [SamplingSettings(), SamplingSettings(temperature=0.9, top_p=0.95, top_logprobs=3),
                SamplingSettings(temperature=1.1, top_k=20, repetition_penalty=1.3, frequency_penalty=0.4),
                SamplingSettings(temperature=0.7, min_p=0.05, presence_penalty=-0.5, logit_bias=((7, 3.0),))]
    out = []
    for i in range(8):
        prompt = repetitive(rng, vocab, rng.randrange(12, 40))
        settings = controls[i % 4]
        if i < 4:
            favoured = rng.sample(range(3, vocab), 3)
            settings = dataclasses.replace(settings, logit_bias=tuple((t, 9.0) for t in favoured),
                                           min_tokens=4 if i == 3 else 0)
            prompt = tuple(rng.choice(favoured) for _ in range(rng.randrange(12, 30)))
        out.append(GenerationRequest(f"s{i}", prompt, settings, seed=100 + i, max_tokens=rng.randrange(5, 30),
                                     ignore_eos=i % 2 == 0, n=2 if i == 5 else 1,
                                     stop_token_ids=(prompt[2],) if i == 3 else ()))
    return out


@pytest.fixture(scope="module")
def spec_engine() -> Engine:
    config = golden_server_config(slots=4, speculative=SPEC)
    return build_engine(config, resolve(config))


class Counting(SchedulerMetrics):
    def __init__(self) -> None:
        self.drafted = self.accepted = 0

    def speculated(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted


def test_golden_requests_are_bit_identical_with_speculation_on_and_off(spec_engine: Engine,
                                                                      running: Runner) -> None:
    off_scheduler, counting = running(spec_engine), Counting()
    on_scheduler = running(spec_engine, speculative=SPEC, metrics=counting)
    reqs = requests(spec_engine.vocab_size)
    for group in (reqs[:3], reqs[3:6], reqs[6:]):  # fewer requests than slots: drafting is on
        off, on = serve(off_scheduler, group), serve(on_scheduler, group)
        assert [{i: o.tokens for i, o in r.items()} for r in on] == [{i: o.tokens for i, o in r.items()} for r in off]
    assert counting.drafted > 0 and counting.accepted > 0, (counting.drafted, counting.accepted)


def test_golden_reference_requests_are_reproduced_with_speculation_on(spec_engine: Engine, running: Runner) -> None:
    cases = golden_requests()
    scheduler = running(spec_engine, speculative=SPEC)
    for i, case in enumerate(cases):
        q = case["request"]
        [out] = serve(scheduler, [GenerationRequest(f"g{i}", tuple(case["prompt_ids"]), SamplingSettings(
            temperature=q["temperature"], top_p=q["nucleus_p"]), seed=q["rng_seed"], max_tokens=q["max_len"])])
        assert [t for t, _, _ in out[0].tokens] == case["output_ids"]


def test_preempted_requests_with_speculation_on_end_as_they_would_alone(running: Runner) -> None:
    """A pool too small for both requests at full length: the younger is preempted, recomputed, and its drafts
    resume; both end with the tokens they get alone without speculation."""
    prompts = [tuple(range(20, 26)) * 2, tuple(range(40, 45)) * 2]
    alone = []
    for p in prompts:
        c = Collector()
        running(spec_fake(num_blocks=16)).submit(req(p, max_tokens=14), c)
        alone.append(c.wait().ids)
    preempting = Preempting()
    engine = spec_fake(num_blocks=10)  # 40 positions: both requests grow to 24-26 positions
    sched = running(engine, speculative=SPEC, metrics=preempting)
    outs = [Collector() for _ in prompts]
    for p, c in zip(prompts, outs):
        sched.submit(req(p, max_tokens=14), c)
    assert [c.wait().ids for c in outs] == alone
    assert preempting.count > 0


class Preempting(SchedulerMetrics):
    def __init__(self) -> None:
        self.count = 0

    def preempted(self) -> None:
        self.count += 1


def test_the_demo_model_quoting_its_prompt_is_bit_identical_with_speculation_on_and_off(running: Runner) -> None:
    """A trained model answering with text its prompt holds (the speculation benchmark's quote workload): most
    drafts are right, and every token, probability and alternative is the same as without them, greedy and
    seeded sampled."""
    from benchmarks.speculative import quote_prompts

    config = golden_server_config(config=str(ROOT / "demo" / "config.json"),
                                  checkpoint=str(ROOT / "demo" / "checkpoint"), slots=4, speculative=SPEC)
    engine = build_engine(config, resolve(config))
    counting = Counting()
    off_scheduler, on_scheduler = running(engine), running(engine, speculative=SPEC, metrics=counting)
    sampled = SamplingSettings(temperature=0.8, top_p=0.95, top_logprobs=2)
    reqs = [GenerationRequest(f"q{i}", tuple(prompt), SamplingSettings(top_logprobs=2) if i % 2 else sampled,
                              seed=40 + i, max_tokens=tokens, ignore_eos=True)
            for i, (prompt, tokens) in enumerate(quote_prompts(6))]
    for group in (reqs[:3], reqs[3:]):  # fewer requests than slots: drafting is on
        off, on = serve(off_scheduler, group), serve(on_scheduler, group)
        assert [{i: o.tokens for i, o in r.items()} for r in on] == [{i: o.tokens for i, o in r.items()} for r in off]
    assert counting.accepted > counting.drafted / 4, (counting.drafted, counting.accepted)


def test_the_wide_reference_is_reproduced_with_speculation_on(running: Runner) -> None:
    """The real Grok-1 vocabulary (the nucleus filter's large-vocabulary branch), the reference's seeded
    requests: the same ids with drafts verified as without."""
    from tests.engine.test_golden_wide import CASES, WIDE, request

    config = golden_server_config(config=str(WIDE / "config.json"), checkpoint=str(WIDE / "checkpoint"), slots=4,
                                  speculative=SPEC)
    engine = build_engine(config, resolve(config))
    counting = Counting()
    scheduler = running(engine, speculative=SPEC, metrics=counting)
    # The reference's random weights write nothing a lookup finds: then requests whose prompts are made of three
    # tokens that a logit_bias of 40 favours over the 131,072 (the reference's settings otherwise), so that
    # drafts are proposed, accepted and rejected. At most three at a time: fewer than the slots, drafting is on.
    reqs = [request(c, i) for i, c in enumerate(CASES)]
    on = serve(scheduler, reqs[:3]) + serve(scheduler, reqs[3:])
    assert [[t for t, _, _ in r[0].tokens] for r in on] == [c["output_ids"] for c in CASES]
    rng = random.Random(5)
    favoured = [rng.sample(range(3, engine.vocab_size), 3) for _ in reqs]
    biased = [dataclasses.replace(r, request_id=r.request_id + "b", prompt=tuple(rng.choice(f) for _ in range(20)),
                                  sampling=dataclasses.replace(r.sampling, logit_bias=tuple((t, 40.0) for t in f)))
              for r, f in zip(reqs, favoured)]
    off_scheduler = running(engine)
    for group in (biased[:3], biased[3:]):
        assert [r[0].tokens for r in serve(scheduler, group)] == [r[0].tokens for r in serve(off_scheduler, group)]
    assert counting.drafted > 0 and counting.accepted > 0, (counting.drafted, counting.accepted)
