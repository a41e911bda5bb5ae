"""gateway.detokenize: the GetPieces stream parser and the in-process detokenizer without processes, and a
local-mode gateway in front of a tokenizer service that cannot give a table."""

from __future__ import annotations

import asyncio
import pathlib

import grpc
import pytest

from gateway.client import GatewayClient
from gateway.detokenize import Decoded, LocalDetokenizer, piece_table
from gateway.errors import GatewayError
from grok.tokenizer.v1 import tokenizer_pb2
from serving_common.detokenizer import PieceTable
from tests.gateway.conftest import fake_stack, start_fake, start_gateway
from tests.procs import GOLDEN, GROK1_TOKENIZER
from tokenizer_service.servicer import piece_messages
from tokenizer_service.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def golden() -> tuple[Tokenizer, PieceTable, list[tokenizer_pb2.GetPiecesResponse]]:
    tok = Tokenizer(GOLDEN / "tokenizer.model")
    table = tok.piece_table()
    return tok, table, piece_messages(table, tok.sha256)


def chunked(table: PieceTable, size: int) -> list[tokenizer_pb2.GetPiecesResponse]:
    one = piece_messages(table, "sha")
    pieces = [p for m in one for p in m.pieces]
    return [tokenizer_pb2.GetPiecesResponse(vocab_size=table.vocab_size, model_sha256="sha", start_id=start,
                                            strip_all_leading_spaces=table.strip_all_leading_spaces,
                                            pieces=pieces[start:start + size])
            for start in range(0, table.vocab_size, size)]


def rejected(chunks: list[tokenizer_pb2.GetPiecesResponse]) -> str:
    with pytest.raises(GatewayError) as caught:
        piece_table(chunks)
    assert caught.value.code == grpc.StatusCode.INTERNAL
    assert "--detokenize local" in caught.value.message
    return caught.value.message


def test_chunks_in_any_size_give_the_same_table(golden) -> None:
    _, table, _ = golden
    assert piece_table(chunked(table, 7)) == table
    assert piece_table(chunked(table, table.vocab_size)) == table


def test_a_stream_that_skips_ids_is_internal_naming_the_gap(golden) -> None:
    _, table, _ = golden
    chunks = chunked(table, 100)
    assert "skipped from id 100 to 200" in rejected([chunks[0], *chunks[2:]])


def test_a_stream_whose_model_changes_midway_is_internal(golden) -> None:
    _, table, _ = golden
    chunks = chunked(table, 100)
    chunks[1].model_sha256 = "other"
    assert "changed while it was sent" in rejected(chunks)


def test_a_short_or_empty_stream_is_internal_counting_the_pieces(golden) -> None:
    _, table, _ = golden
    chunks = chunked(table, 100)
    assert f"200 pieces for a vocabulary of {table.vocab_size}" in rejected(chunks[:2])
    assert "0 pieces for a vocabulary of 0" in rejected([])


def test_a_piece_with_a_byte_out_of_range_is_internal(golden) -> None:
    _, table, _ = golden
    chunks = chunked(table, table.vocab_size)
    byte_piece = next(p for p in chunks[0].pieces if p.is_byte)
    byte_piece.byte_value = 256
    assert "needs a byte value in 0..255" in rejected(chunks)


def test_local_detokenizer_gives_decode_streams_texts_and_flushes_held_bytes(golden) -> None:
    tok, table, _ = golden
    ids = tok.encode("héllo wörld 😀") + [i for i, b in enumerate(tok.byte_value) if b == 0xE4]  # a cut-off character
    local = LocalDetokenizer(table)
    reference = tok.stream_decoder()

    async def run() -> tuple[list[str], str]:
        texts: list[str] = []
        for start in range(0, len(ids), 3):  # model messages of up to 3 ids
            decoded = await local.push(ids[start:start + 3])
            assert decoded.text == "".join(decoded.token_texts) and decoded.alternative_texts is None
            texts += decoded.token_texts
        return texts, await local.finish()

    texts, tail = asyncio.run(run())
    assert texts == reference.push_many(ids)
    assert tail == reference.flush() == "\ufffd"
    assert "".join(texts) + tail == tok.decode(ids)


def test_local_detokenizer_reads_the_prompt_first_and_gives_alternatives_in_context() -> None:
    tok = Tokenizer(GROK1_TOKENIZER)
    ids = tok.encode("The gateway limits the prompt")
    local = LocalDetokenizer(tok.piece_table(), ids[:2])
    large = tok.encode("large")[0]

    async def run() -> tuple[Decoded, Decoded, str]:
        return await local.push(ids[2:3], [[large]]), await local.push(ids[3:]), await local.finish()

    first, rest, tail = asyncio.run(run())
    assert first.token_texts == [" limits"] and first.alternative_texts == [[" large"]]
    assert "The gateway" + first.text + rest.text + tail == tok.decode(ids)


def test_local_detokenizer_rejects_an_unknown_id_as_invalid_argument(golden) -> None:
    _, table, _ = golden
    with pytest.raises(GatewayError) as caught:
        asyncio.run(LocalDetokenizer(table).push([1, table.vocab_size]))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message.startswith("tokenizer service: token_ids[1] = ")
    assert caught.value.violations[0].field == "token_ids[1]"


def test_local_gateway_before_a_tokenizer_without_get_pieces_is_internal_naming_the_flag(
        tmp_path: pathlib.Path) -> None:
    # The fake tokenizer implements no GetPieces, as a tokenizer service older than the gateway would.
    stack = fake_stack(tmp_path, [["--slots", "1"]], "--detokenize", "local")
    try:
        with GatewayClient(stack.address, timeout=30) as client:
            for _ in range(2):  # a failed fetch is not cached as the answer: the next request asks again
                with pytest.raises(grpc.RpcError) as caught:
                    client.complete("p|ab", max_tokens=2)
                assert caught.value.code() == grpc.StatusCode.INTERNAL
                assert "does not implement GetPieces" in caught.value.details()
                assert "--detokenize local" in caught.value.details()
        # The table is asked for before the model: its one slot is free for a default gateway beside it.
        remote = start_gateway(stack.tokenizer.address, [stack.models[0].address], tmp_path).wait_serving(60)
        try:
            with GatewayClient(remote.address, timeout=30) as client:
                assert client.complete("p|ab", max_tokens=2).usage.completion_tokens == 2
        finally:
            remote.terminate()
        assert not [r for r in stack.gateway.log_records() if r.get("level") == "error"]
    finally:
        stack.stop()


def test_an_older_tokenizer_service_still_gets_alternatives_texts_from_single_piece_decodes(
        tmp_path: pathlib.Path) -> None:
    # A tokenizer service that predates DecodeStream's alternatives answers none: each alternative is then
    # decoded alone (Decode), so alternatives keep a text rather than an empty one.
    tokenizer = start_fake("tokenizer", tmp_path, "--legacy")
    model = start_fake("model", tmp_path)
    gateway = start_gateway(tokenizer.address, [model.address], tmp_path)
    try:
        for service in (tokenizer, model, gateway):
            service.wait_serving(60)
        with GatewayClient(gateway.address, timeout=30) as client:
            reply = client.complete("xy|hello", max_tokens=1, top_logprobs=2)
        assert reply.text == "hello"
        assert [(t.id, t.text) for t in reply.tokens[0].top_tokens] == [(reply.tokens[0].id, "hello"),
                                                                        (reply.tokens[0].id + 1, "wor")]
    finally:
        for service in (gateway, model, tokenizer):
            service.terminate()
