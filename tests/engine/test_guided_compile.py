"""Constraints that once crashed, stalled or answered INTERNAL (docs/reliability.md, round three, 1-3) against the real compiler:
each is refused with a ConstraintError naming `constraint.<field>` before a slot is taken, in a worker process
whose crash or overrun costs only that request; and what fails only mid-stream ends only its own request."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from model_service.constraint import Bounds, Constraint, ConstraintKind, json_depth, paren_depth, size_problem
from model_service.guided import Guidance, next_mask
from model_service.requests import ErrorKind, FinishReason, GenerationRequest, SchedulerError
from model_service.sampling_settings import SamplingSettings, build_mask
from model_service.grammar_pool import WorkerPool
from model_service.structured import ConstraintError, GrammarCompiler, Vocabulary
from serving_common.limits import MAX_CONSTRAINT_DEPTH, MAX_GRAMMAR_RULES
from tests.engine.conftest import Runner
from tests.engine.test_guided import MaskingFake
from tests.engine.test_scheduler import Collector, req
from tests.procs import ROOT

VOCAB = MaskingFake.vocab_size
# A worker that says it is ready and then never answers: a compile that does not end.
HUNG_WORKER = [sys.executable, "-c", "import sys; print('{\"ready\": true}', flush=True); sys.stdin.read()"]


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "z"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "z"\n'


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    return Vocabulary(str(ROOT / "demo" / "tokenizer.model"))


@pytest.fixture(scope="module")
def compiler(vocabulary: Vocabulary) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(vocabulary, VOCAB, workers=1)
    yield c
    c.close()


def refused(compiler: GrammarCompiler, kind: ConstraintKind, text: str) -> str:
    with pytest.raises(ConstraintError) as caught:
        compiler.compile(Constraint(kind, text))
    message = str(caught.value)
    assert message.startswith(f"constraint.{kind.value}: "), message
    return message


@pytest.mark.parametrize("chain", [lark_chain, gbnf_chain])
def test_a_3000_rule_chain_is_refused_by_the_rule_bound(compiler: GrammarCompiler, chain: object) -> None:
    text = chain(3000)  # type: ignore[operator]
    assert len(text) < 64 * 1024  # under the text cap: the rule bound is what refuses it
    assert f"over the limit of {MAX_GRAMMAR_RULES}" in refused(compiler, ConstraintKind.GRAMMAR, text)


def test_a_chain_under_the_bound_compiles(compiler: GrammarCompiler) -> None:
    assert compiler.compile(Constraint(ConstraintKind.GRAMMAR, gbnf_chain(MAX_GRAMMAR_RULES - 2))).first_mask.any()


def test_a_segfault_in_the_library_costs_only_that_compile(vocabulary: Vocabulary) -> None:
    # Bounds raised past what the library survives: the chain that killed the service kills only the worker.
    unbounded = GrammarCompiler(vocabulary, VOCAB, workers=1, bounds=Bounds(rules=10**6))
    try:
        with pytest.raises(ConstraintError, match=r"^constraint\.grammar: the grammar library failed on it \(it was "
                                                  r"killed by SIGSEGV\)"):
            unbounded.compile(Constraint(ConstraintKind.GRAMMAR, lark_chain(3000)))
        assert unbounded.compile(Constraint(ConstraintKind.REGEX, "ok+")).first_mask.any()  # a fresh worker
    finally:
        unbounded.close()


def test_a_compile_over_its_time_limit_is_refused_and_the_worker_replaced(vocabulary: Vocabulary) -> None:
    hung = GrammarCompiler(vocabulary, VOCAB, workers=1, compile_seconds=0.2, worker_command=HUNG_WORKER)
    try:
        for _ in range(2):  # not remembered as a refusal (it depends on the load), and each worker is replaced
            with pytest.raises(ConstraintError, match=r"^constraint\.regex: took longer than 0\.2 s to compile"):
                hung.compile(Constraint(ConstraintKind.REGEX, "a+"))
    finally:
        hung.close()


def test_the_event_loop_runs_while_a_constraint_compiles(vocabulary: Vocabulary) -> None:
    hung = GrammarCompiler(vocabulary, VOCAB, workers=1, compile_seconds=1.0, worker_command=HUNG_WORKER)
    order: list[str] = []

    async def other_stream() -> None:
        for _ in range(100):
            await asyncio.sleep(0)
        order.append("other stream done")

    async def constrained() -> None:
        try:
            await hung.compile_async(Constraint(ConstraintKind.REGEX, "b+"))
        except ConstraintError:
            order.append("compile refused")

    async def both() -> None:
        await asyncio.gather(constrained(), other_stream())

    try:
        asyncio.run(both())
    finally:
        hung.close()
    assert order == ["other stream done", "compile refused"]


def test_a_schema_nested_past_python_recursion_is_refused(compiler: GrammarCompiler) -> None:
    text = "[" * 5000 + "]" * 5000  # json.loads raised RecursionError (not a ValueError): INTERNAL
    assert "5000 levels of JSON nesting" in refused(compiler, ConstraintKind.JSON_SCHEMA, text)
    deep = '{"items":' * 200 + "{}" + "}" * 200
    assert f"over the limit of {MAX_CONSTRAINT_DEPTH}" in refused(compiler, ConstraintKind.JSON_SCHEMA, deep)


@pytest.mark.parametrize("kind,text", [
    (ConstraintKind.JSON_SCHEMA, '{"$ref": "#"}'),
    (ConstraintKind.JSON_SCHEMA, '{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, '
                                 '"$ref": "#/$defs/a"}'),
    (ConstraintKind.REGEX, r"[^\x00-\x{10FFFF}]"),
    (ConstraintKind.GRAMMAR, 'start: start "a"'),
])
def test_a_constraint_no_text_satisfies_is_refused(compiler: GrammarCompiler, kind: ConstraintKind, text: str) -> None:
    assert "no text can satisfy it" in refused(compiler, kind, text)  # NoExtensionBias escaped as INTERNAL


def test_a_grammar_the_library_gives_up_on_at_once_is_refused(compiler: GrammarCompiler) -> None:
    assert "too complex to follow at token 1" in refused(compiler, ConstraintKind.GRAMMAR, 'start: "a" start')


def test_the_schema_true_is_any_json_and_false_is_refused(compiler: GrammarCompiler) -> None:
    anything = compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, "true")).first_mask
    assert (anything == compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, "{}")).first_mask).all()
    assert "matches no JSON value" in refused(compiler, ConstraintKind.JSON_SCHEMA, "false")


def test_a_refusal_is_remembered(vocabulary: Vocabulary) -> None:
    compiler = GrammarCompiler(vocabulary, VOCAB, workers=1)
    try:
        first = refused(compiler, ConstraintKind.JSON_SCHEMA, '{"$ref": "#"}')
        compiler.pool.close()
        compiler.pool = WorkerPool(HUNG_WORKER, 1, 0.2, 4)  # a worker would now time out: the memory answers
        assert refused(compiler, ConstraintKind.JSON_SCHEMA, '{"$ref": "#"}') == first
    finally:
        compiler.close()


def test_the_scans_count_nesting_without_recursion() -> None:
    assert json_depth('{"a": "[[[[", "b": [[1], {"c": "\\"{"}]}') == 3
    assert paren_depth(r"(a(b)\(c)") == 2
    assert paren_depth('start: "((((" (x)', quotes=True) == 1
    assert size_problem(Constraint(ConstraintKind.REGEX, "(" * 10**6)) != ""


def test_nothing_left_at_a_later_step_ends_the_request_without_drawing_pad(running: Runner,
                                                                          vocabulary: Vocabulary) -> None:
    # The choice "ab"/"ac" may start (its "a" tokens are allowed) but every token that could follow is blocked.
    after_a = [i for i, t in enumerate(vocabulary.tokens) if t[:1] in (b"b", b"c") or t[:2] in (b"ab", b"ac")]
    engine = MaskingFake()
    grammars = GrammarCompiler(vocabulary, engine.vocab_size, workers=1)
    try:
        sched = running(engine, grammars=grammars)
        out = Collector()
        sched.submit(req((5,), max_tokens=8, blocked=tuple(after_a),
                         constraint=Constraint(ConstraintKind.CHOICE, choices=("ab", "ac"))), out)
        out.wait()
    finally:
        grammars.close()
    error = out.last.error
    assert error is not None and error.kind is ErrorKind.INVALID_ARGUMENT, out.last
    assert error.message.startswith("constraint.choice: after 1 tokens nothing the constraint allows")
    assert 0 not in out.ids and [vocabulary.tokens[i] for i in out.ids] == [b"a"]


def test_next_mask_never_returns_an_empty_mask(compiler: GrammarCompiler) -> None:
    compiled = compiler.compile(Constraint(ConstraintKind.REGEX, "[0-9]"))
    request = GenerationRequest("r", (5,), constraint=Constraint(ConstraintKind.REGEX, "[0-9]"))
    nothing = np.zeros((VOCAB,), bool)
    with pytest.raises(SchedulerError, match=r"^constraint\.regex: after 0 tokens nothing"):
        next_mask(compiled.guide(), nothing, request, 0)
    assert next_mask(compiled.guide(), build_mask(VOCAB, 0, (), ()), request, 0).any()


def test_a_per_step_limit_mid_stream_ends_only_its_request(running: Runner, vocabulary: Vocabulary) -> None:
    # The probe follows the first allowed tokens ("a", "a", ...) and passes; the fake draws "a" then "z", after
    # which the library's step limit trips inside advance: INVALID_ARGUMENT for this request, not INTERNAL.
    grammar = 'start: "a"+ "z" inf\ninf: "z" inf'
    engine = MaskingFake(step_delay=0.01)
    grammars = GrammarCompiler(vocabulary, engine.vocab_size, workers=1)
    try:
        sched = running(engine, grammars=grammars)
        compiled = Guidance(engine, grammars).compile(GenerationRequest("c", (5,), constraint=Constraint(
            ConstraintKind.GRAMMAR, grammar)))
        plain, constrained = Collector(), Collector()
        sched.submit(req((40,), max_tokens=12, ignore_eos=True), plain)
        sched.submit(req((100,), max_tokens=12, constraint=Constraint(ConstraintKind.GRAMMAR, grammar)), constrained,
                     grammar=compiled)
        constrained.wait()
        plain.wait()
    finally:
        grammars.close()
    error = constrained.last.error
    assert error is not None and error.kind is ErrorKind.INVALID_ARGUMENT, constrained.last
    assert error.message.startswith("constraint.grammar: too complex to follow at token"), error.message
    assert plain.ids == list(range(41, 53)) and plain.last.finish_reason is FinishReason.LENGTH


def test_compile_async_compiles_or_refuses_naming_the_field(compiler: GrammarCompiler) -> None:
    engine = MaskingFake()
    guidance = Guidance(engine, compiler)
    request = GenerationRequest("s", (5,), SamplingSettings(),
                                constraint=Constraint(ConstraintKind.CHOICE, choices=("7",)))
    compiled = asyncio.run(guidance.compile_async(request))
    assert compiled is not None and compiled.first_mask.any()
    with pytest.raises(SchedulerError) as caught:
        asyncio.run(guidance.compile_async(GenerationRequest("t", (5,), constraint=Constraint(
            ConstraintKind.GRAMMAR, json.dumps("x")))))
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT and caught.value.message.startswith("constraint.grammar: ")


def test_compiles_past_the_waiting_bound_are_resource_exhausted(vocabulary: Vocabulary) -> None:
    hung = GrammarCompiler(vocabulary, VOCAB, workers=1, compile_seconds=0.5, worker_command=HUNG_WORKER,
                           max_waiting=1)
    guidance = Guidance(MaskingFake(), hung)

    async def two() -> SchedulerError:
        first = asyncio.ensure_future(hung.compile_async(Constraint(ConstraintKind.REGEX, "c+")))
        await asyncio.sleep(0)  # the first is now waiting on its worker
        try:
            with pytest.raises(SchedulerError) as caught:
                await guidance.compile_async(GenerationRequest("b", (5,), constraint=Constraint(
                    ConstraintKind.REGEX, "d+")))
            return caught.value
        finally:
            with pytest.raises(ConstraintError):
                await first

    try:
        busy = asyncio.run(two())
    finally:
        hung.close()
    assert busy.kind is ErrorKind.RESOURCE_EXHAUSTED and "retry later" in busy.message
