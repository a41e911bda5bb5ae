"""The demo model chats: /v1/chat/completions through the whole stack, called with the `openai` package.

The demo model was trained on dialogues rendered by the gateway's own chat template (demo_build/corpus/*.jsonl), so a
question about its subject, with or without a system message, gets an answer made of the corpus's sentences,
and a greeting gets a short greeting back. Greedy (temperature 0), so the answers are what `make run` shows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from gateway.client import GatewayClient

from tests.demo.conftest import corpus_prose, sentences
from tests.demo.launcher import Launched

pytestmark = pytest.mark.slow

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def openai_client(demo_stack: Launched) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{demo_stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(client: OpenAI, *messages: tuple[str, str]) -> tuple[str, str]:
    reply = client.chat.completions.create(model="grok-1", temperature=0, max_tokens=MAX_TOKENS,
                                           messages=[{"role": role, "content": text} for role, text in messages])
    return reply.choices[0].message.content or "", reply.choices[0].finish_reason


def assert_corpus_answer(answer: str, finish: str) -> None:
    prose = corpus_prose()
    assert finish == "stop", answer  # the model ended its answer (EOS), not the token limit
    assert len(sentences(answer)) >= 1 and len(answer.split()) >= 8, answer
    for sentence in sentences(answer):
        assert sentence in prose, sentence


def test_question_about_the_gateway_gets_an_answer_of_corpus_sentences(openai_client: OpenAI) -> None:
    answer, finish = chat(openai_client, ("user", "What does the gateway do?"))
    assert_corpus_answer(answer, finish)
    assert "gateway" in answer


def test_question_with_a_system_message_gets_an_answer_of_corpus_sentences(openai_client: OpenAI) -> None:
    answer, finish = chat(openai_client, ("system", "You are a helpful assistant."),
                          ("user", "What does the gateway do?"))
    assert_corpus_answer(answer, finish)
    assert "gateway" in answer


@pytest.mark.parametrize("question, subject", [("What is a slot?", "slot"),
                                               ("What is nucleus sampling?", "sampling"),
                                               ("What is the key and value memory?", "key and value memory")])
def test_questions_about_other_subjects_get_corpus_answers_about_them(openai_client: OpenAI, question: str,
                                                                     subject: str) -> None:
    answer, finish = chat(openai_client, ("user", question))
    assert_corpus_answer(answer, finish)
    assert subject in answer.lower()  # on topic, at the start of a sentence too ("Sampling happens ...")


@pytest.mark.parametrize("system", [None, "You are a helpful assistant."])
def test_hello_gets_a_short_greeting_back(openai_client: OpenAI, system: str | None) -> None:
    messages = ([("system", system)] if system else []) + [("user", "Hello!")]
    answer, finish = chat(openai_client, *messages)
    assert finish == "stop"
    assert answer.startswith(("Hello", "Hi")), answer
    assert 1 <= len(answer.split()) <= 20, answer


def test_the_greeting_ends_where_the_model_begins_the_next_turn_in_each_streamed_choice(openai_client: OpenAI) -> None:
    """The corpus's two-turn dialogues have EOS only after the last turn, so the model goes on past "Hello! ..." with
    "\n\nUser: ...": the answer ends there (gateway.chat_template.DEFAULT_TURN_STARTS), for each of n choices."""
    stream = openai_client.chat.completions.create(model="grok-1", temperature=0, max_tokens=MAX_TOKENS, n=2,
                                                   stream=True, messages=[{"role": "user", "content": "Hello!"}])
    texts, finishes = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert finishes == ["stop", "stop"] and texts[0] == texts[1], texts
    assert texts[0].startswith("Hello") and "User:" not in texts[0] and 1 <= len(texts[0].split()) <= 20, texts[0]


def test_a_streamed_chat_answer_is_the_same_answer(openai_client: OpenAI) -> None:
    answer, _ = chat(openai_client, ("user", "What does the gateway do?"))
    stream = openai_client.chat.completions.create(
        model="grok-1", temperature=0, max_tokens=MAX_TOKENS, stream=True,
        messages=[{"role": "user", "content": "What does the gateway do?"}])
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == answer


def test_chat_content_starts_at_its_first_word_and_its_first_token_keeps_the_space(openai_client: OpenAI) -> None:
    """The model writes " The" after "Assistant:"; the content is "The ..." (as OpenAI's and vLLM's), streamed or
    not, while the logprobs report the token's own text and bytes."""
    messages = [{"role": "user", "content": "What does the gateway do?"}]
    reply = openai_client.chat.completions.create(model="grok-1", temperature=0, max_tokens=MAX_TOKENS,
                                                  messages=messages, logprobs=True)  # type: ignore[arg-type]
    content = reply.choices[0].message.content or ""
    assert content.startswith("The gateway"), content
    tokens = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert tokens[0].token.startswith(" ") and tokens[0].bytes == list(tokens[0].token.encode())
    assert "".join(t.token for t in tokens) == " " + content
    stream = openai_client.chat.completions.create(model="grok-1", temperature=0, max_tokens=MAX_TOKENS,
                                                   messages=messages, stream=True)  # type: ignore[arg-type]
    deltas = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert deltas[0].startswith("The") and "".join(deltas) == content


def test_grpc_chat_answers_as_http_chat_does(demo_stack: Launched, openai_client: OpenAI) -> None:
    """GatewayService.Chat renders with the same template and answers the same text as /v1/chat/completions at the
    same settings (gRPC's default temperature is 0, HTTP's OpenAI's 1: the HTTP call sets it)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What does the gateway do?"}]
    http = openai_client.chat.completions.create(model="grok-1", temperature=0, max_tokens=MAX_TOKENS,
                                                 messages=messages)  # type: ignore[arg-type]
    with GatewayClient(demo_stack.address, timeout=120) as client:
        replies = list(client.chat(messages, max_tokens=MAX_TOKENS))
    text = "".join(r.text for r in replies)
    assert text == http.choices[0].message.content and text.startswith("The gateway")
    assert replies[-1].usage.prompt_tokens == http.usage.prompt_tokens  # type: ignore[union-attr]
    assert replies[0].tokens[0].text.startswith(" ")
