"""A client stream that fell behind catches up in fewer messages: the gateway joins the messages of a completion
that queued up while the one before them was being written (stream_buffer.bounded's `join`,
pipeline.join_responses), with the same text, tokens, usage and finish as one message each would have given."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.pipeline import join_responses
from gateway.stream_buffer import bounded
from grok.gateway.v1 import gateway_pb2


def token_message(i: int, index: int = 0, last: bool = False) -> gateway_pb2.GenerateResponse:
    message = gateway_pb2.GenerateResponse(text=f"t{i} ", tokens=[gateway_pb2.Token(id=i, text=f"t{i} ")],
                                           index=index)
    if last:
        message.finish_reason = gateway_pb2.FINISH_REASON_LENGTH
        message.usage.CopyFrom(gateway_pb2.Usage(prompt_tokens=3, completion_tokens=i + 1, total_tokens=i + 4))
        message.timings.total_seconds = 1.5
    return message


def test_a_completions_messages_join_into_one_with_the_last_ones_state() -> None:
    first = token_message(0)
    first.prompt_logprobs.add(id=7, text="x")
    assert join_responses(first, token_message(1))
    assert join_responses(first, token_message(2, last=True))
    assert first.text == "t0 t1 t2 "
    assert [t.id for t in first.tokens] == [0, 1, 2] and [t.text for t in first.tokens] == ["t0 ", "t1 ", "t2 "]
    assert first.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert first.usage.completion_tokens == 3 and first.usage.prompt_tokens == 3
    assert first.timings.total_seconds == 1.5
    assert [p.id for p in first.prompt_logprobs] == [7]


def test_messages_of_other_completions_and_after_a_last_one_are_not_joined() -> None:
    assert not join_responses(token_message(0, index=0), token_message(1, index=1))
    last = token_message(0, last=True)
    assert not join_responses(last, token_message(1))
    assert last.text == "t0 " and len(last.tokens) == 1
    scored = token_message(1)
    scored.prompt_logprobs.add(id=7, text="x")  # a completion's first message (n > 1): its own
    assert not join_responses(token_message(0), scored)


def test_what_queued_while_the_reader_was_away_comes_as_one_message() -> None:
    async def read(join: bool) -> list[gateway_pb2.GenerateResponse]:
        everything = asyncio.Event()

        async def produced(count: int) -> AsyncIterator[gateway_pb2.GenerateResponse]:
            for i in range(count):
                yield token_message(i, last=i == count - 1)
            everything.set()  # the read-ahead took the last one

        out = []
        async for message in bounded(produced(6), join=join_responses if join else None):
            out.append(message)
            await everything.wait()  # a writer busy until the rest have queued up behind its message
        return out

    joined, alone = asyncio.run(read(True)), asyncio.run(read(False))
    assert len(alone) == 6
    assert len(joined) < 6, [m.text for m in joined]
    assert "".join(m.text for m in joined) == "".join(m.text for m in alone) == "t0 t1 t2 t3 t4 t5 "
    assert [t.id for m in joined for t in m.tokens] == list(range(6))
    assert joined[-1].finish_reason == alone[-1].finish_reason and joined[-1].usage == alone[-1].usage
    assert not any(m.finish_reason for m in joined[:-1])
