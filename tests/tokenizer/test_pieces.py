"""The piece table (GetPieces): the incremental detokenizer over it gives exactly the Tokenizer's text.

A gateway with `--detokenize local` runs `StreamDecoder` over a `PieceTable` it received over gRPC; if
any id's facts differed from the Tokenizer's, its text would differ from DecodeStream's.
"""

from __future__ import annotations

import pathlib
import random

import pytest

from gateway.detokenize import piece_table
from grok.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from serving_common.detokenizer import PieceSurface, PieceTable, TokenizerInputError
from tests.procs import GOLDEN
from tokenizer_service.servicer import PIECES_PER_MESSAGE, piece_messages
from tokenizer_service.tokenizer import Tokenizer


def id_sequences(tok: Tokenizer, count: int, seed: int) -> list[list[int]]:
    """Random sequences weighted towards what is hard: byte pieces (multibyte and invalid UTF-8), control
    pieces, the bare "▁" piece and space-led pieces at the start."""
    rng = random.Random(seed)
    bytes_ = [i for i, b in enumerate(tok.byte_value) if b >= 0]
    special = [i for i in (tok.sp.bos_id(), tok.sp.eos_id(), tok.sp.pad_id(), tok.sp.unk_id(),
                           tok.sp.piece_to_id("\u2581")) if i >= 0]
    spaced = [i for i in range(min(tok.vocab_size, 5000)) if tok.sp.id_to_piece(i).startswith("\u2581")]
    pools = [bytes_, special, spaced, list(range(tok.vocab_size))]
    return [[rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 24))] for _ in range(count)]


def streamed(decoder_source: Tokenizer | PieceTable, ids: list[int]) -> tuple[list[str], str]:
    decoder = decoder_source.stream_decoder()
    return decoder.push_many(ids), decoder.flush()


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model: pathlib.Path) -> Tokenizer:
    return Tokenizer(demo_model)


@pytest.mark.parametrize("which", ["grok1", "golden", "demo"])
def test_decoder_over_the_table_gives_the_tokenizers_per_token_text(which: str, grok_tokenizer: Tokenizer,
                                                                   demo_tokenizer: Tokenizer) -> None:
    tok = {"grok1": grok_tokenizer, "golden": Tokenizer(GOLDEN / "tokenizer.model"), "demo": demo_tokenizer}[which]
    table = tok.piece_table()
    assert table.vocab_size == tok.vocab_size
    assert table.strip_all_leading_spaces == tok.strip_all_leading_spaces
    for ids in id_sequences(tok, 400, seed=len(which)):
        deltas, tail = streamed(table, ids)
        assert (deltas, tail) == streamed(tok, ids), ids
        assert "".join(deltas) + tail == tok.sp.decode(ids), ids


def test_piece_text_is_the_id_decoded_alone(grok_tokenizer: Tokenizer) -> None:
    table = grok_tokenizer.piece_table()
    ids = [i for i, b in enumerate(grok_tokenizer.byte_value) if b >= 0] + list(range(0, table.vocab_size, 97))
    for token_id in ids:
        assert table.piece_text(token_id) == grok_tokenizer.decode([token_id]), token_id


def test_table_rejects_out_of_range_ids_like_the_tokenizer(grok_tokenizer: Tokenizer) -> None:
    table = grok_tokenizer.piece_table()
    with pytest.raises(TokenizerInputError, match=r"token_ids\[1\] = 131072 is out of range: valid ids are 0..131071"):
        table.stream_decoder().push_many([5, table.vocab_size])
    with pytest.raises(TokenizerInputError, match="out of range"):
        table.piece_text(-1)


def test_table_needs_exactly_one_of_a_byte_or_a_surface_per_piece() -> None:
    with pytest.raises(ValueError, match="piece 0: needs a byte value in 0..255 or a surface, not both"):
        PieceTable((65,), (PieceSurface("A", "A"),), False)
    with pytest.raises(ValueError, match="piece 1: needs a byte value"):
        PieceTable((65, -1), (None, None), False)
    with pytest.raises(ValueError, match="2 byte values but 1 surfaces"):
        PieceTable((65, -1), (None,), False)


def test_piece_messages_round_trip_through_the_gateways_parser(grok_tokenizer: Tokenizer) -> None:
    table = grok_tokenizer.piece_table()
    messages = piece_messages(table, grok_tokenizer.sha256)
    assert len(messages) == -(-table.vocab_size // PIECES_PER_MESSAGE)
    assert all(m.ByteSize() < 4 * 1024 * 1024 for m in messages)  # under gRPC's default message limit
    assert piece_table(messages) == table


def test_get_pieces_over_grpc_rebuilds_the_tokenizers_table(stub: tokenizer_pb2_grpc.TokenizerServiceStub,
                                                           grok_tokenizer: Tokenizer) -> None:
    chunks = list(stub.GetPieces(tokenizer_pb2.GetPiecesRequest(), timeout=60))
    assert [c.start_id for c in chunks] == list(range(0, grok_tokenizer.vocab_size, PIECES_PER_MESSAGE))
    assert {c.model_sha256 for c in chunks} == {grok_tokenizer.sha256}
    assert piece_table(chunks) == grok_tokenizer.piece_table()
    # Built once: a second call is answered from the cached messages and says the same.
    assert list(stub.GetPieces(tokenizer_pb2.GetPiecesRequest(), timeout=60)) == chunks
