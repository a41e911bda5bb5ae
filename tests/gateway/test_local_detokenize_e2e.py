"""`--detokenize local` on the real golden stack: a second gateway in front of the session's tokenizer and
model services must answer exactly as the default (remote DecodeStream) gateway does, token for token."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest

from gateway.client import GatewayClient
from grok.gateway.v1 import gateway_pb2
from serving_common.healthcheck import check
from tests.gateway.conftest import Stack, start_gateway
from tests.gateway.test_e2e import GOLDEN_REQUESTS, ended, frozen, gateway_ended, golden_options
from tests.procs import Service
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_gateway(golden_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    gateway = start_gateway(golden_stack.tokenizer.address, [m.address for m in golden_stack.models],
                            tmp_path_factory.mktemp("local"), "--detokenize", "local")
    try:
        yield gateway.wait_serving(60)
    finally:
        gateway.terminate()


def token_view(messages: list[gateway_pb2.GenerateResponse]) -> list[tuple]:
    """Everything a client sees per token, independent of how tokens were grouped into messages."""
    return [(t.id, t.text, round(t.logprob, 5), [(a.id, a.text, round(a.logprob, 5)) for a in t.top_tokens])
            for m in messages for t in m.tokens]


def generate(address: str, prompt: str, **options: object) -> list[gateway_pb2.GenerateResponse]:
    with GatewayClient(address, timeout=120) as client:
        return list(client.generate(prompt, **options))


@pytest.mark.parametrize("case", GOLDEN_REQUESTS, ids=[f"golden{i}" for i in range(len(GOLDEN_REQUESTS))])
def test_local_golden_requests_equal_the_reference_and_the_remote_gateway_per_token(
        golden_stack: Stack, local_gateway: Service, case: dict) -> None:
    prompt, options = case["request"]["prompt"], {**golden_options(case), "top_logprobs": 3}
    local = generate(local_gateway.address, prompt, **options)
    remote = generate(golden_stack.address, prompt, **options)
    assert "".join(m.text for m in local) == case["output_text"]
    assert [t.id for m in local for t in m.tokens] == case["output_ids"]
    assert all(m.text == "".join(t.text for t in m.tokens) for m in local)
    # Texts per token (multibyte characters held back to the token that completes them), probabilities
    # and the alternatives' texts (each piece decoded alone) are what the remote path gives.
    assert token_view(local) == token_view(remote)
    assert local[-1].finish_reason == remote[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH


def test_local_stop_string_across_tokens_ends_the_completion_as_remote_does(golden_stack: Stack,
                                                                           local_gateway: Service) -> None:
    case = GOLDEN_REQUESTS[2]
    stop = "ldch"  # spans the pieces of several tokens
    replies = []
    for address in (local_gateway.address, golden_stack.address):
        with GatewayClient(address, timeout=120) as client:
            replies.append(client.complete(case["request"]["prompt"], stop=[stop], **golden_options(case)))
    local, remote = replies
    assert local.text == case["output_text"][: case["output_text"].index(stop)] == remote.text
    assert local.finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert local.usage.completion_tokens == remote.usage.completion_tokens


def test_local_deadline_is_deadline_exceeded(golden_stack: Stack, local_gateway: Service) -> None:
    with GatewayClient(local_gateway.address) as client:
        stream = client.generate("In the beginning", max_tokens=120, ignore_eos=True, timeout=1.0)
        next(stream)
        expired = ended(local_gateway, "DEADLINE_EXCEEDED")
        with frozen(golden_stack.models[0]):  # the deadline passes while the model cannot run
            wait_until(gateway_ended(local_gateway, "DEADLINE_EXCEEDED", expired), 10,
                       message="the gateway never ended the call at its deadline")
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_local_stream_survives_the_tokenizer_dying_and_the_table_is_prefetched_again_after_restart(
        golden_stack: Stack, local_gateway: Service, tmp_path: pathlib.Path) -> None:
    prompt, options = "In the beginning", dict(max_tokens=110, ignore_eos=True)  # greedy: the same text each time
    with GatewayClient(local_gateway.address, timeout=60) as client:
        expected = client.complete(prompt, **options).text
        stream = client.generate(prompt, **options)
        first = next(stream)
        old = golden_stack.tokenizer
        with frozen(golden_stack.models[0]):  # most of the 110 tokens are generated after the kill
            old.kill()
            wait_until(lambda: not check(local_gateway.address), timeout=10)
        # Ids become text in the gateway: the request in flight needs no tokenizer to finish.
        rest = list(stream)
        assert first.text + "".join(m.text for m in rest) == expected
        assert rest[-1].usage.completion_tokens == 110
        with pytest.raises(grpc.RpcError) as caught:  # a new prompt cannot be encoded
            client.complete(prompt, **options)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        # At debug level: its successful calls (GetPieces below) are logged only then.
        golden_stack.tokenizer = Service("tokenizer_service", [*old.proc.args[3:], "--log-level", "debug"], old.port,
                                         log_dir=tmp_path)
        golden_stack.tokenizer.wait_serving(60)
        wait_until(lambda: check(local_gateway.address), timeout=10)
        # The restarted service may serve another model: the gateway asks it for its table again as soon
        # as it is up, before any request needs it.
        wait_until(lambda: any(r.get("method") == "GetPieces" for r in golden_stack.tokenizer.log_records()))
        assert client.complete(prompt, **options).text == expected
    assert not [r for r in local_gateway.log_records() if r.get("level") == "error"]


def test_local_n_samples_echo_and_prompt_logprobs_equal_the_remote_gateway(golden_stack: Stack,
                                                                          local_gateway: Service) -> None:
    # Each completion has its own detokenizer, and the scored prompt's texts come from the table: the same
    # messages per completion index as the remote path.
    prompt = "In the beginning"
    options = dict(max_tokens=12, ignore_eos=True, temperature=0.9, seed=7, n=2, echo=True, prompt_logprobs=2,
                   top_logprobs=2)
    local = generate(local_gateway.address, prompt, **options)
    remote = generate(golden_stack.address, prompt, **options)
    for index in (0, 1):
        mine = [m for m in local if m.index == index]
        theirs = [m for m in remote if m.index == index]
        assert "".join(m.text for m in mine) == "".join(m.text for m in theirs)
        assert mine[0].text.startswith(prompt)
        assert token_view(mine) == token_view(theirs)
        assert [(p.id, p.text, round(p.logprob, 5), [(a.id, a.text) for a in p.top_tokens])
                for m in mine for p in m.prompt_logprobs] == \
               [(p.id, p.text, round(p.logprob, 5), [(a.id, a.text) for a in p.top_tokens])
                for m in theirs for p in m.prompt_logprobs]
        assert mine[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert "".join(m.text for m in local if m.index == 0) != "".join(m.text for m in local if m.index == 1)
    assert [p.text for m in local if m.index == 0 for p in m.prompt_logprobs][0]
