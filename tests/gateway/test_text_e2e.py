"""Texts in context end to end on the real golden stack, over gRPC and HTTP (the official openai package),
streamed and not, with echo and alternatives, through the default gateway (the tokenizer service's
DecodeStream) and a `--detokenize local` one: a completion's text is what the prompt's text lacks
(`prompt + text == decode(prompt ids + completion ids)`), every token and alternative reads as it does in
context (" the", not "the"), and alternatives are only tokens the step could have drawn (no padding, no
fake 0.0 / -9999 values).

Generation is restricted to pieces that start with a space ("▁the", ...), so the first generated token
is one whose space SentencePiece would drop at the start of a text, and fewer tokens may be drawn than
alternatives are asked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest

from gateway.client import GatewayClient
from grok.gateway.v1 import gateway_pb2
from tests.gateway.conftest import Stack, start_gateway
from tests.gateway.http_client import sdk
from tests.procs import GOLDEN, Service, free_port
from tokenizer_service.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
SPACED = ("\u2581the", "\u2581of", "\u2581with", "\u2581as")
ASKED = 6  # alternatives asked for: more than the allowed tokens


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(GOLDEN / "tokenizer.model")


@pytest.fixture(scope="module")
def allowed(tok: Tokenizer) -> list[int]:
    ids = [tok.sp.piece_to_id(p) for p in SPACED]
    assert tok.sp.unk_id() not in ids
    return ids


@pytest.fixture(scope="module")
def options(allowed: list[int]) -> dict:
    return dict(max_tokens=4, ignore_eos=True, temperature=1.0, seed=7, allowed_token_ids=allowed)


@pytest.fixture(scope="module")
def local_gateway(golden_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A `--detokenize local` gateway (gRPC and HTTP) on the golden stack's services."""
    http_port = free_port()
    gateway = start_gateway(golden_stack.tokenizer.address, [m.address for m in golden_stack.models],
                            tmp_path_factory.mktemp("text_local"), "--detokenize", "local", http_port=http_port)
    gateway.http_url = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    try:
        yield gateway.wait_serving(120)
    finally:
        gateway.terminate()


def in_context(tok: Tokenizer, before: Sequence[int], token_id: int) -> str:
    """What `token_id` adds to the decode of `before` (no byte pieces here: nothing is held back)."""
    head = tok.decode(list(before))
    whole = tok.decode([*before, token_id])
    assert whole.startswith(head)
    return whole[len(head):]


def check_tokens(tok: Tokenizer, before: list[int], tokens: Sequence[gateway_pb2.Token], allowed: list[int]) -> None:
    """Each token's and alternative's text in context; alternatives only drawable tokens, real values."""
    before = list(before)
    for token in tokens:
        assert token.text == in_context(tok, before, token.id) and token.text.startswith(" ")
        tops = list(token.top_tokens)
        assert 1 <= len(tops) <= len(allowed) < ASKED  # fewer than asked: no padding
        assert len({t.id for t in tops}) == len(tops) and {t.id for t in tops} <= set(allowed)
        for top in tops:
            assert top.probability > 0 and top.logprob == pytest.approx(math.log(top.probability), abs=1e-5)
            assert top.text == in_context(tok, before, top.id) and top.text.startswith(" ")
        before.append(token.id)


def token_view(tokens: Sequence[gateway_pb2.Token]) -> list[tuple]:
    return [(t.id, t.text, round(t.logprob, 5), [(a.id, a.text, round(a.logprob, 5)) for a in t.top_tokens])
            for t in tokens]


def test_grpc_completion_text_is_what_the_prompt_text_lacks_in_both_detokenize_modes(
        golden_stack: Stack, local_gateway: Service, tok: Tokenizer, allowed: list[int], options: dict) -> None:
    prompt_ids = tok.encode(PROMPT)
    assert tok.decode(prompt_ids) == PROMPT
    views = []
    for address in (golden_stack.address, local_gateway.address):
        with GatewayClient(address, timeout=120) as client:
            complete = client.complete(PROMPT, top_logprobs=ASKED, **options)
            streamed = list(client.generate(PROMPT, top_logprobs=ASKED, **options))
            echoed = client.complete(PROMPT, echo=True, **options)
            echoed_stream = list(client.generate(PROMPT, echo=True, **options))
        ids = [t.id for t in complete.tokens]
        assert complete.text.startswith(" ")  # the first piece keeps its space after the prompt
        assert PROMPT + complete.text == tok.decode(prompt_ids + ids)
        assert "".join(m.text for m in streamed) == complete.text
        assert [t.id for m in streamed for t in m.tokens] == ids
        assert echoed.text == "".join(m.text for m in echoed_stream) == PROMPT + complete.text
        check_tokens(tok, prompt_ids, complete.tokens, allowed)
        check_tokens(tok, prompt_ids, [t for m in streamed for t in m.tokens], allowed)
        views.append(token_view(complete.tokens))
    assert views[0] == views[1]


def test_grpc_scored_prompt_tokens_concatenate_to_the_prompt(golden_stack: Stack, local_gateway: Service,
                                                             tok: Tokenizer) -> None:
    prompt_ids = tok.encode(PROMPT)
    views = []
    for address in (golden_stack.address, local_gateway.address):
        with GatewayClient(address, timeout=120) as client:
            reply = client.complete(PROMPT, max_tokens=1, prompt_logprobs=3)
        scored = list(reply.prompt_logprobs)
        assert [p.id for p in scored] == prompt_ids and "".join(p.text for p in scored) == PROMPT
        for position, prompt_token in enumerate(scored[1:], start=1):
            assert prompt_token.text == in_context(tok, prompt_ids[:position], prompt_token.id)
            for top in prompt_token.top_tokens:
                assert top.probability > 0
                if tok.byte_value[top.id] < 0:  # (a byte piece may start a character: held back)
                    assert top.text == in_context(tok, prompt_ids[:position], top.id)
        views.append([(p.id, p.text, [(a.id, a.text) for a in p.top_tokens]) for p in scored])
    assert views[0] == views[1]


def test_grpc_alternatives_the_nucleus_removed_are_not_reported(golden_stack: Stack) -> None:
    with GatewayClient(golden_stack.address, timeout=120) as client:
        reply = client.complete(PROMPT, max_tokens=6, temperature=1.0, top_p=0.05, seed=3, ignore_eos=True,
                                top_logprobs=3)
    assert len(reply.tokens) == 6
    for token in reply.tokens:
        tops = list(token.top_tokens)
        assert tops and all(t.probability > 0 and math.isfinite(t.logprob) for t in tops)
        assert token.id in [t.id for t in tops] and len({t.id for t in tops}) == len(tops)
        if len(tops) == 1:  # a nucleus of one token: drawn with probability 1, truly
            assert tops[0].probability == pytest.approx(1.0) and token.logprob == pytest.approx(0.0, abs=1e-6)
    assert any(len(t.top_tokens) < 3 for t in reply.tokens)


def http_urls(golden_http_url: str, local_gateway: Service) -> list[str]:
    return [golden_http_url, local_gateway.http_url]  # type: ignore[attr-defined]


def check_top_logprobs(entries: list[dict[str, float]], allowed_count: int) -> None:
    for entry in entries:
        assert 1 <= len(entry) <= allowed_count
        assert all(key.startswith(" ") and -9999 < value <= 0 for key, value in entry.items())


def test_openai_completion_with_echo_and_logprobs_concatenates(golden_stack: Stack, golden_http_url: str,
                                                               local_gateway: Service, allowed: list[int],
                                                               options: dict) -> None:
    with GatewayClient(golden_stack.address, timeout=120) as client:
        expected = client.complete(PROMPT, **options).text
    body = dict(model="grok-1", prompt=PROMPT, max_tokens=4, temperature=1.0, seed=7, logprobs=5,
                extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    for url in http_urls(golden_http_url, local_gateway):
        client = sdk(url)
        choice = client.completions.create(**body).choices[0]
        assert choice.text == expected
        lp = choice.logprobs
        assert "".join(lp.tokens) == expected and lp.text_offset[0] == 0
        check_top_logprobs(lp.top_logprobs, len(allowed))
        echoed = client.completions.create(echo=True, **body).choices[0]
        assert echoed.text == PROMPT + expected
        assert "".join(echoed.logprobs.tokens) == echoed.text  # the prompt's tokens, then the completion's
        assert echoed.logprobs.text_offset == [len("".join(echoed.logprobs.tokens[:i]))
                                               for i in range(len(echoed.logprobs.tokens))]
        check_top_logprobs(echoed.logprobs.top_logprobs[-4:], len(allowed))
        chunks = list(client.completions.create(stream=True, echo=True, **body))
        assert "".join(c.choices[0].text for c in chunks) == PROMPT + expected
        streamed_tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert "".join(streamed_tokens) == PROMPT + expected


def test_openai_chat_logprobs_read_in_context(golden_http_url: str, local_gateway: Service,
                                              allowed: list[int]) -> None:
    body = dict(model="grok-1", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4, temperature=1.0,
                seed=7, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    contents = []
    for url in http_urls(golden_http_url, local_gateway):
        client = sdk(url)
        choice = client.chat.completions.create(**body).choices[0]
        content = choice.message.content
        # The content starts at its first word; the tokens keep their texts, the separator space included.
        assert not content.startswith(" ") and "".join(t.token for t in choice.logprobs.content) == " " + content
        for token in choice.logprobs.content:
            assert token.token.startswith(" ") and 1 <= len(token.top_logprobs) <= len(allowed)
            assert all(top.token.startswith(" ") and -9999 < top.logprob <= 0 for top in token.top_logprobs)
        chunks = list(client.chat.completions.create(stream=True, **body))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
        contents.append(content)
    assert contents[0] == contents[1]


def test_openai_nucleus_alternatives_are_never_padded(golden_http_url: str) -> None:
    choice = sdk(golden_http_url).completions.create(
        model="grok-1", prompt=PROMPT, max_tokens=6, temperature=1.0, top_p=0.05, seed=3, logprobs=3,
        extra_body={"ignore_eos": True}).choices[0]
    for entry in choice.logprobs.top_logprobs:
        assert entry and all(-9999 < value <= 0 for value in entry.values())
    assert any(len(entry) < 3 for entry in choice.logprobs.top_logprobs)
