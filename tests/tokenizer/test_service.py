"""The tokenizer service over gRPC (real subprocess, real Grok-1 tokenizer): results equal
sentencepiece's, limits and bad ids give INVALID_ARGUMENT with the valid range, logs carry request ids."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from grok.tokenizer.v1 import tokenizer_pb2 as pb
from grok.tokenizer.v1 import tokenizer_pb2_grpc
from tests.procs import GROK1_TOKENIZER, Service
from tests.tokenizer.conftest import MAX_BATCH, MAX_TEXT_BYTES, MAX_TOKENS
from tests.waiting import wait_until
from tokenizer_service.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "  leading spaces and  double  spaces ", "emoji 😀🚀 and CJK 中文字", "e\u0301\u0301 combining",
         "tabs\tand\nnewlines\n\n", "", "\ufffd literal replacement", "def f(x):\n    return x ** 2\n"]
Stub = tokenizer_pb2_grpc.TokenizerServiceStub


def rpc_error(call: object, *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, timeout=10)  # type: ignore[operator]
    return caught.value


def test_encode_equals_sentencepiece_ids(stub: Stub, grok_tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        assert list(stub.Encode(pb.EncodeRequest(text=text), timeout=10).token_ids) == grok_tokenizer.sp.encode(text)


def test_encode_adds_bos_and_eos_only_on_request(stub: Stub, grok_tokenizer: Tokenizer) -> None:
    ids = grok_tokenizer.sp.encode("Hi there")
    reply = stub.Encode(pb.EncodeRequest(text="Hi there", add_bos=True, add_eos=True), timeout=10)
    assert list(reply.token_ids) == [1, *ids, 2]


def test_encode_batch_keeps_request_order(stub: Stub, grok_tokenizer: Tokenizer) -> None:
    texts = TEXTS[:MAX_BATCH]
    reply = stub.EncodeBatch(pb.EncodeBatchRequest(requests=[pb.EncodeRequest(text=t) for t in texts]), timeout=10)
    assert [list(r.token_ids) for r in reply.responses] == [grok_tokenizer.sp.encode(t) for t in texts]


def test_decode_equals_sentencepiece_text(stub: Stub, grok_tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        ids = [1, *grok_tokenizer.sp.encode(text), 2]
        assert stub.Decode(pb.DecodeRequest(token_ids=ids), timeout=10).text == grok_tokenizer.sp.decode(ids)


def test_decode_stream_deltas_concatenate_to_decode(stub: Stub, grok_tokenizer: Tokenizer) -> None:
    ids = grok_tokenizer.sp.encode("stream 😀 中 done") + [grok_tokenizer.sp.piece_to_id("<0xE4>")]
    chunks = [ids[i:i + 2] for i in range(0, len(ids), 2)] + [[]]
    replies = list(stub.DecodeStream(iter(pb.DecodeStreamRequest(token_ids=c) for c in chunks), timeout=10))
    assert len(replies) == len(chunks) + 1  # one per message, plus the flush of the held-back E4
    for chunk, reply in zip(chunks, replies):
        assert len(reply.token_texts) == len(chunk) and "".join(reply.token_texts) == reply.text
    assert "\ufffd" not in "".join(r.text for r in replies[:-1])
    assert replies[-1].text == "\ufffd" and not replies[-1].token_texts
    assert "".join(r.text for r in replies) == grok_tokenizer.sp.decode(ids)


def test_decode_stream_after_prompt_ids_reads_tokens_in_context(stub: Stub, grok_tokenizer: Tokenizer) -> None:
    ids = grok_tokenizer.encode("The gateway limits the prompt")
    prompt, completion = ids[:2], ids[2:]
    other = grok_tokenizer.encode("large")[0]
    requests = [pb.DecodeStreamRequest(prompt_ids=prompt, token_ids=completion[:1],
                                       alternatives=[pb.AlternativeIds(token_ids=[other, completion[0]])]),
                pb.DecodeStreamRequest(token_ids=completion[1:])]
    replies = list(stub.DecodeStream(iter(requests), timeout=10))
    assert replies[0].token_texts == [" limits"]
    assert [list(a.texts) for a in replies[0].alternative_texts] == [[" large", " limits"]]
    assert not replies[1].alternative_texts
    assert "The gateway" + "".join(r.text for r in replies) == grok_tokenizer.decode(prompt + completion)


def test_decode_stream_refuses_prompt_ids_after_tokens_and_mismatched_alternatives(stub: Stub) -> None:
    late = iter([pb.DecodeStreamRequest(token_ids=[5]), pb.DecodeStreamRequest(prompt_ids=[6], token_ids=[7])])
    call = stub.DecodeStream(late, timeout=10)
    next(call)
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in caught.value.details()
    uneven = pb.DecodeStreamRequest(token_ids=[5, 6], alternatives=[pb.AlternativeIds(token_ids=[7])])
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.DecodeStream(iter([uneven]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one per token id" in caught.value.details()


def test_empty_decode_stream_is_ok(stub: Stub) -> None:
    assert list(stub.DecodeStream(iter([]), timeout=10)) == []


def test_get_info_describes_the_model(stub: Stub) -> None:
    info = stub.GetInfo(pb.GetInfoRequest(), timeout=10)
    assert (info.vocab_size, info.pad_id, info.bos_id, info.eos_id, info.unk_id) == (131072, 0, 1, 2, 3)
    assert info.model_sha256 == hashlib.sha256(GROK1_TOKENIZER.read_bytes()).hexdigest()
    assert info.model_path == str(GROK1_TOKENIZER)


def test_out_of_range_ids_are_invalid_argument_with_range(stub: Stub) -> None:
    for bad in (131072, -1):
        err = rpc_error(stub.Decode, pb.DecodeRequest(token_ids=[5, bad]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"token_ids[1] = {bad}" in err.details() and "0..131071" in err.details()


def test_out_of_range_id_ends_decode_stream(stub: Stub) -> None:
    requests = iter([pb.DecodeStreamRequest(token_ids=[5]), pb.DecodeStreamRequest(token_ids=[999999])])
    call = stub.DecodeStream(requests, timeout=10)
    assert next(call).token_texts
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "0..131071" in caught.value.details()


def test_oversized_inputs_are_invalid_argument_naming_the_limit(stub: Stub) -> None:
    cases = [
        (stub.Encode, pb.EncodeRequest(text="x" * (MAX_TEXT_BYTES + 1)), "--max-text-bytes"),
        (stub.Encode, pb.EncodeRequest(text="é" * (MAX_TEXT_BYTES // 2 + 1)), "--max-text-bytes"),
        (stub.EncodeBatch, pb.EncodeBatchRequest(requests=[pb.EncodeRequest(text="a")] * (MAX_BATCH + 1)), "--max-batch"),
        (stub.EncodeBatch, pb.EncodeBatchRequest(requests=[pb.EncodeRequest(text="x" * (MAX_TEXT_BYTES + 1))]),
         "requests[0].text"),
        (stub.Decode, pb.DecodeRequest(token_ids=[5] * (MAX_TOKENS + 1)), "--max-tokens"),
    ]
    for method, request, needle in cases:
        err = rpc_error(method, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
        assert needle in err.details()
    stream = stub.DecodeStream(iter([pb.DecodeStreamRequest(token_ids=[5] * (MAX_TOKENS + 1))]), timeout=10)
    with pytest.raises(grpc.RpcError) as caught:
        list(stream)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-tokens" in caught.value.details()


def test_text_at_the_limit_is_accepted(stub: Stub) -> None:
    assert stub.Encode(pb.EncodeRequest(text="x" * MAX_TEXT_BYTES), timeout=10).token_ids


def test_logs_are_json_with_the_callers_request_id(stub: Stub, service: Service) -> None:
    """A failed call is logged (at info) with the caller's request id; a successful one is one of several calls
    per request, which the gateway's access line speaks for: it shows only at debug level."""
    stub.Encode(pb.EncodeRequest(text="traced"), metadata=[("x-request-id", "fine-41")], timeout=10)
    with pytest.raises(grpc.RpcError):
        stub.Encode(pb.EncodeRequest(text="x" * (MAX_TEXT_BYTES + 1)), metadata=[("x-request-id", "trace-42")],
                    timeout=10)
    def logged() -> set[tuple[str | None, str | None, str | None]]:
        return {(r.get("request_id"), r.get("method"), r.get("code")) for r in service.log_records()
                if r.get("msg") == "rpc"}
    wait_until(lambda: ("trace-42", "Encode", "INVALID_ARGUMENT") in logged(), 5, interval=0.1,
               message=lambda: f"the failed call was not logged with its request id: {logged()}")
    assert not any(rid == "fine-41" for rid, _, _ in logged())
    assert any(r.get("msg") == "serving" and r.get("port") == service.port for r in service.log_records())
