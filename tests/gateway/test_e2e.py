"""The real stack on 127.0.0.1: tokenizer_service + model_service (golden tiny Grok-1, float32) + gateway.

One stack per session. The seeded golden requests must return the reference's recorded text exactly.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest

from gateway.client import GatewayClient, completion_request
from grok.gateway.v1 import gateway_pb2
from serving_common.healthcheck import check
from tests.gateway.conftest import Stack
from tests.procs import GOLDEN, Service, grpcurl
from tests.waiting import wait_until
from tokenizer_service.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

GOLDEN_REQUESTS = json.loads((GOLDEN / "pipeline_fp32.json").read_text())["requests"]


def model_metric(stack: Stack, name: str) -> float:
    args = list(stack.models[0].proc.args)
    port = args[args.index("--metrics-port") + 1]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", body, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def golden_options(case: dict) -> dict:
    r = case["request"]
    # The reference's runner has no EOS stop, so neither may this request.
    return dict(max_tokens=r["max_len"], temperature=r["temperature"], top_p=r["nucleus_p"], seed=r["rng_seed"],
                ignore_eos=True)


@pytest.mark.parametrize("case", GOLDEN_REQUESTS, ids=[f"golden{i}" for i in range(len(GOLDEN_REQUESTS))])
def test_golden_request_returns_the_reference_text_and_complete_equals_the_stream(golden_stack: Stack,
                                                                                  case: dict) -> None:
    with GatewayClient(golden_stack.address, timeout=120) as client:
        messages = list(client.generate(case["request"]["prompt"], **golden_options(case)))
        complete = client.complete(case["request"]["prompt"], **golden_options(case))
        by_ids = completion_request("", **golden_options(case))  # the same prompt as token ids
        by_ids.prompt_token_ids.extend(case["prompt_ids"])
        token_prompt = client.stub.Complete(by_ids, timeout=120)
    assert [t.id for t in token_prompt.tokens] == case["output_ids"] and token_prompt.text == case["output_text"]
    streamed = "".join(m.text for m in messages)
    assert [t.id for m in messages for t in m.tokens] == case["output_ids"]
    assert streamed == case["output_text"]
    assert complete.text == streamed
    assert messages[-1].usage.prompt_tokens == len(case["prompt_ids"])
    assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH


def test_stop_string_across_tokens_ends_the_golden_completion(golden_stack: Stack) -> None:
    # That a stop also cancels the model stream is asserted deterministically against a slow fake model
    # in test_gateway.py; the golden model can finish its 20 tokens before a cancellation arrives.
    case = GOLDEN_REQUESTS[2]  # "� be]�J�ldch1һw3llcY�VY"
    text = case["output_text"]
    stop = "ldch"  # spans the pieces of several tokens
    with GatewayClient(golden_stack.address, timeout=120) as client:
        reply = client.complete(case["request"]["prompt"], stop=[stop], **golden_options(case))
    assert reply.text == text[: text.index(stop)]
    assert reply.finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert reply.usage.completion_tokens < len(case["output_ids"])


@contextlib.contextmanager
def frozen(service: Service) -> Iterator[None]:
    """SIGSTOP the process for the block: the tiny model cannot race ahead of what the test does."""
    service.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        service.proc.send_signal(signal.SIGCONT)


RECLAIMED = 'grok_model_slot_reclaim_seconds_count{{reason="{}"}}'


def gateway_ended(gateway: Service, code: str, before: int) -> Callable[[], bool]:
    """True once the gateway has logged more calls ending with `code` than `before`: the end (the
    client's cancel, the deadline) has been passed on to the model."""
    return lambda: ended(gateway, code) > before


def ended(gateway: Service, code: str) -> int:
    return sum(1 for r in gateway.log_records() if r.get("msg") == "request" and r.get("code") == code)


def generated_so_far(stack: Stack, before: float) -> float:
    return model_metric(stack, "grok_model_generated_tokens_total") - before


def test_cancelling_a_stream_frees_the_model_slot(golden_stack: Stack) -> None:
    with GatewayClient(golden_stack.address, timeout=120) as client:
        for attempt in range(3):
            reclaimed = model_metric(golden_stack, RECLAIMED.format("cancelled"))
            generated = model_metric(golden_stack, "grok_model_generated_tokens_total")
            stream = client.generate("In the beginning", max_tokens=120, ignore_eos=True)
            next(stream)
            cancelled = ended(golden_stack.gateway, "CANCELLED")
            with frozen(golden_stack.models[0]):  # the cancel waits in the model's socket; no token is made
                stream.close()
                try:
                    wait_until(gateway_ended(golden_stack.gateway, "CANCELLED", cancelled), 10)
                    break
                except AssertionError:
                    pass
            # The tiny model makes its 120 tokens in ~0.4 s: a test process starved that long between the first
            # token and the freeze finds the call already complete, and nothing left to cancel. Only then again.
            wait_until(lambda: model_metric(golden_stack, "grok_model_active_slots") == 0, message="a slot stayed busy")
            assert generated_so_far(golden_stack, generated) >= 120, "the gateway never ended the cancelled call"
        else:
            pytest.fail("the call completed before the cancel in every attempt: the box is too busy for this test")
        # The model frees the slot because of the cancel, long before its 120 tokens.
        wait_until(lambda: model_metric(golden_stack, RECLAIMED.format("cancelled")) == reclaimed + 1, 10,
                   message=lambda: f"no slot reclaimed for the cancel; "
                                   f"{generated_so_far(golden_stack, generated):.0f} tokens were made")
        wait_until(lambda: model_metric(golden_stack, "grok_model_active_slots") == 0, message="a slot stayed busy")
        assert model_metric(golden_stack, "grok_model_generated_tokens_total") - generated < 120
        assert client.complete("In the beginning", max_tokens=4).usage.completion_tokens == 4


def test_deadline_reaches_the_model_through_the_gateway_and_frees_the_slot(golden_stack: Stack) -> None:
    reclaimed = model_metric(golden_stack, RECLAIMED.format("deadline"))
    generated = model_metric(golden_stack, "grok_model_generated_tokens_total")
    expired = ended(golden_stack.gateway, "DEADLINE_EXCEEDED")  # before the call: on a slow box its first
    started = time.monotonic()  # token may come just before its deadline
    with GatewayClient(golden_stack.address) as client:
        stream = client.generate("In the beginning", max_tokens=120, ignore_eos=True, timeout=1.0)
        next(stream)
        with frozen(golden_stack.models[0]):  # the deadline passes while the model cannot run (or has passed)
            wait_until(gateway_ended(golden_stack.gateway, "DEADLINE_EXCEEDED", expired), 10,
                       message=lambda: "the gateway never ended the call at its deadline; its last calls: "
                       + str([r for r in golden_stack.gateway.log_records() if r.get("msg") == "request"][-2:]))
            # The model's copy of the deadline lies a transit time (and two processes' clocks) later than the
            # gateway's: keep it stopped until that has surely passed too, so it wakes past its deadline.
            wait_until(lambda: time.monotonic() > started + 1.3, 5)
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Reclaimed for the deadline (the gateway passed it on), not as a plain cancellation.
    wait_until(lambda: model_metric(golden_stack, RECLAIMED.format("deadline")) == reclaimed + 1, 10,
               message=lambda: f"reclaimed for the deadline {model_metric(golden_stack, RECLAIMED.format('deadline'))}"
               f" (before: {reclaimed}), as cancelled {model_metric(golden_stack, RECLAIMED.format('cancelled'))}")
    assert model_metric(golden_stack, "grok_model_generated_tokens_total") - generated < 120


def test_prompt_over_the_context_is_invalid_argument(golden_stack: Stack) -> None:
    with GatewayClient(golden_stack.address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.complete("In the beginning", max_tokens=121)  # 8 prompt tokens + 121 > 128
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("max_tokens:")


def test_grpcurl_generate_against_the_real_stack(golden_stack: Stack) -> None:
    case = GOLDEN_REQUESTS[1]
    options = golden_options(case)
    body = json.dumps({"prompt": case["request"]["prompt"], "sampling": {
        "max_tokens": options["max_tokens"], "temperature": options["temperature"], "top_p": options["top_p"],
        "seed": options["seed"], "ignore_eos": True}})
    out = grpcurl("-plaintext", "-d", body, golden_stack.address, "grok.gateway.v1.GatewayService/Generate")
    assert out.returncode == 0, out.stderr
    messages = [json.loads(chunk) for chunk in out.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert "".join(m.get("text", "") for m in messages) == case["output_text"]


def test_token_texts_add_up_and_alternatives_read_in_context(golden_stack: Stack) -> None:
    case = GOLDEN_REQUESTS[0]  # its output has byte-fallback pieces that decode to replacement characters
    with GatewayClient(golden_stack.address, timeout=120) as client:
        messages = list(client.generate(case["request"]["prompt"], top_logprobs=3, **golden_options(case)))
    tok = Tokenizer(GOLDEN / "tokenizer.model")
    before = list(case["prompt_ids"])
    for message in messages:
        assert message.text == "".join(t.text for t in message.tokens)
        for token in message.tokens:
            assert 1 <= len(token.top_tokens) <= 3 and all(top.probability > 0 for top in token.top_tokens)
            probabilities = [top.probability for top in token.top_tokens]
            assert probabilities == sorted(probabilities, reverse=True)
            for top in token.top_tokens:  # what it would have added in the chosen token's place
                if not held_back(tok, before) and not held_back(tok, before + [top.id]):
                    assert tok.decode(before) + top.text == tok.decode(before + [top.id])
            before.append(token.id)
    assert "".join(m.text for m in messages) == case["output_text"]


def held_back(tok: Tokenizer, ids: list[int]) -> bool:
    """Whether `ids` end inside a character (its bytes are held back until it completes)."""
    decoder = tok.stream_decoder()
    decoder.push_many(ids)
    return decoder.pending


def test_real_tokenizer_down_is_unavailable_then_recovers(golden_stack: Stack, tmp_path: pathlib.Path) -> None:
    case = GOLDEN_REQUESTS[1]
    old = golden_stack.tokenizer
    old.kill()
    with GatewayClient(golden_stack.address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.complete(case["request"]["prompt"], **golden_options(case))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_until(lambda: not check(golden_stack.address))
        golden_stack.tokenizer = Service("tokenizer_service", old.proc.args[3:], old.port, log_dir=tmp_path)
        golden_stack.tokenizer.wait_serving(60)
        wait_until(lambda: check(golden_stack.address), timeout=10)
        assert client.complete(case["request"]["prompt"], **golden_options(case)).text == case["output_text"]
