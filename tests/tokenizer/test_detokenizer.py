"""Deterministic cases of the incremental detokenizer against sentencepiece 0.2.3's decode (Grok-1 model)."""

from __future__ import annotations

import hashlib
import pathlib

import pytest

from serving_common.detokenizer import REPLACEMENT, TokenizerInputError, decode_byte_run
from tokenizer_service.tokenizer import Tokenizer


def byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    return [tok.sp.piece_to_id(f"<0x{b:02X}>") for b in data]


def stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    decoder = tok.stream_decoder()
    deltas = [decoder.push(i) for i in ids]
    return deltas, decoder.flush()


def test_emoji_split_over_byte_pieces_is_held_until_complete(grok_tokenizer: Tokenizer) -> None:
    ids = byte_ids(grok_tokenizer, "😀".encode())
    deltas, tail = stream(grok_tokenizer, ids)
    assert deltas == ["", "", "", "😀"]
    assert tail == ""


@pytest.mark.parametrize("data", [b"\xe4\xb8", b"\xf0\x9f\x98", b"\xc3", b"\x80", b"\xe4\x41", b"\xc0\x80",
                                  b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff\xe4\xb8\xad"])
def test_invalid_byte_runs_decode_like_sentencepiece(grok_tokenizer: Tokenizer, data: bytes) -> None:
    ids = byte_ids(grok_tokenizer, data)
    deltas, tail = stream(grok_tokenizer, ids)
    assert "".join(deltas) + tail == grok_tokenizer.sp.decode(ids)


def test_truncated_character_becomes_one_replacement_per_byte(grok_tokenizer: Tokenizer) -> None:
    # sentencepiece (unlike Python's "replace") gives U+FFFD for every byte of a cut-off character.
    ids = byte_ids(grok_tokenizer, b"\xe4\xb8")
    assert grok_tokenizer.sp.decode(ids) == REPLACEMENT * 2
    deltas, tail = stream(grok_tokenizer, ids)
    assert deltas == ["", ""] and tail == REPLACEMENT * 2


def test_invalid_continuation_is_settled_immediately(grok_tokenizer: Tokenizer) -> None:
    deltas, tail = stream(grok_tokenizer, byte_ids(grok_tokenizer, b"\xe4A"))
    assert deltas == ["", REPLACEMENT + "A"] and tail == ""


def test_encoded_replacement_character_is_emitted(grok_tokenizer: Tokenizer) -> None:
    ids = byte_ids(grok_tokenizer, REPLACEMENT.encode())
    deltas, _ = stream(grok_tokenizer, ids)
    assert deltas == ["", "", REPLACEMENT]


def test_non_byte_piece_flushes_held_bytes_first(grok_tokenizer: Tokenizer) -> None:
    hello = grok_tokenizer.sp.piece_to_id("▁hello")
    ids = byte_ids(grok_tokenizer, b"\xe4\xb8") + [hello]
    deltas, tail = stream(grok_tokenizer, ids)
    assert deltas == ["", "", REPLACEMENT * 2 + " hello"] and tail == ""
    assert "".join(deltas) == grok_tokenizer.sp.decode(ids)


def test_leading_space_dropped_only_at_start(grok_tokenizer: Tokenizer) -> None:
    tok = grok_tokenizer
    hello, bare = tok.sp.piece_to_id("▁hello"), tok.sp.piece_to_id("▁")
    cases = [[hello, hello], [tok.sp.bos_id(), hello], [bare, hello], [bare, bare, hello],
             [tok.sp.unk_id(), hello], byte_ids(tok, b" ") + [hello]]
    for ids in cases:
        deltas, tail = stream(tok, ids)
        assert "".join(deltas) + tail == tok.sp.decode(ids), ids
    assert stream(tok, [tok.sp.bos_id(), hello])[0] == ["", "hello"]
    assert stream(tok, [bare, hello])[0] == ["", " hello"]


def test_control_tokens_decode_to_nothing(grok_tokenizer: Tokenizer) -> None:
    info = grok_tokenizer.info()
    deltas, tail = stream(grok_tokenizer, [info.pad_id, info.bos_id, info.eos_id])
    assert deltas == ["", "", ""] and tail == ""


def test_unknown_piece_decodes_to_its_surface(grok_tokenizer: Tokenizer) -> None:
    unk = grok_tokenizer.info().unk_id
    deltas, _ = stream(grok_tokenizer, [unk, unk])
    assert "".join(deltas) == grok_tokenizer.sp.decode([unk, unk]) != ""


def test_push_many_attributes_text_to_the_completing_token(grok_tokenizer: Tokenizer) -> None:
    ids = grok_tokenizer.encode("a 中") + byte_ids(grok_tokenizer, "😀".encode())
    texts = grok_tokenizer.stream_decoder().push_many(ids)
    assert len(texts) == len(ids)
    assert "".join(texts) == grok_tokenizer.sp.decode(ids)
    assert texts[-4:] == ["", "", "", "😀"]


def test_out_of_range_id_is_rejected_with_the_valid_range(grok_tokenizer: Tokenizer) -> None:
    decoder = grok_tokenizer.stream_decoder()
    with pytest.raises(TokenizerInputError, match=r"token_ids\[1\] = 131072 .*0\.\.131071"):
        decoder.push_many([5, grok_tokenizer.vocab_size])
    with pytest.raises(TokenizerInputError, match="0..131071"):
        grok_tokenizer.decode([-1])


def test_decode_byte_run_keeps_only_an_undecided_prefix() -> None:
    run = bytearray(b"ab\xe4\xb8")
    assert decode_byte_run(run, final=False) == "ab"
    assert run == bytearray(b"\xe4\xb8")
    assert decode_byte_run(run, final=True) == REPLACEMENT * 2
    assert run == bytearray()


def test_encode_has_no_bos_by_default_and_adds_specials_on_request(grok_tokenizer: Tokenizer) -> None:
    plain = grok_tokenizer.encode("Hello world")
    assert plain == grok_tokenizer.sp.encode("Hello world")
    assert grok_tokenizer.encode("Hello world", add_bos=True, add_eos=True) == [1, *plain, 2]


def test_info_reports_special_ids_and_checksum(grok_tokenizer: Tokenizer) -> None:
    info = grok_tokenizer.info()
    assert (info.vocab_size, info.pad_id, info.bos_id, info.eos_id, info.unk_id) == (131072, 0, 1, 2, 3)
    assert info.model_sha256 == hashlib.sha256(pathlib.Path(info.model_path).read_bytes()).hexdigest()
