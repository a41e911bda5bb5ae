"""The demo tokenizer: trained from the shipped corpus, 1024 pieces, byte fallback, fixed special ids,
reproducible byte for byte, and servable by the tokenizer service."""

from __future__ import annotations

import pathlib

import pytest
import sentencepiece

from demo_build import train_tokenizer
from tokenizer_service.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def demo_sp(demo_model: pathlib.Path) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(demo_model))


def test_demo_model_has_1024_pieces_and_grok_special_ids(demo_sp: sentencepiece.SentencePieceProcessor) -> None:
    assert demo_sp.get_piece_size() == 1024
    assert (demo_sp.pad_id(), demo_sp.bos_id(), demo_sp.eos_id(), demo_sp.unk_id()) == (0, 1, 2, 3)
    assert [demo_sp.id_to_piece(i) for i in range(4)] == ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
    assert all(demo_sp.is_control(i) for i in range(3)) and demo_sp.is_unknown(3)


def test_demo_model_falls_back_to_bytes_and_round_trips(demo_sp: sentencepiece.SentencePieceProcessor) -> None:
    assert sum(demo_sp.is_byte(i) for i in range(1024)) == 256
    text = "Serving  models: 😀 中文 Ωmega\tend\n"
    ids = demo_sp.encode(text)
    assert any(demo_sp.is_byte(i) for i in ids)
    assert 3 not in ids  # nothing is unknown with byte fallback
    assert demo_sp.decode(ids) == text


def test_training_is_deterministic(demo_model: pathlib.Path) -> None:
    assert train_tokenizer.train() == demo_model.read_bytes()


def test_corpus_is_30_to_80_kb_of_text_lines() -> None:
    files = sorted(train_tokenizer.CORPUS_DIR.glob("*.txt"))
    size = sum(f.stat().st_size for f in files)
    assert 30_000 <= size <= 80_000
    assert len(list(train_tokenizer.corpus_lines(train_tokenizer.CORPUS_DIR))) > 100


def test_stream_decoder_matches_decode_on_the_demo_model(demo_model: pathlib.Path) -> None:
    tok = Tokenizer(demo_model)
    ids = tok.encode("The tokenizer streams 😀 and 中文 without broken characters.")
    decoder = tok.stream_decoder()
    assert "".join(decoder.push_many(ids)) + decoder.flush() == tok.sp.decode(ids)


def test_dialogues_are_rendered_by_the_gateways_chat_template() -> None:
    dialogues = list(train_tokenizer.dialogue_documents(train_tokenizer.CORPUS_DIR))
    assert len(dialogues) >= 50
    assert dialogues[0] == ("User: What does the gateway do?\n\nAssistant: The gateway is the only part that clients "
                            "see. It validates input, applies limits, forwards deadlines, and maps errors to status "
                            "codes that a client can act on.")
    assert any(d.startswith("System: ") for d in dialogues)
    assert list(train_tokenizer.corpus_documents(train_tokenizer.CORPUS_DIR))[-len(dialogues):] == dialogues


def test_a_served_chat_prompt_encodes_as_the_start_of_its_training_text(
        demo_sp: sentencepiece.SentencePieceProcessor) -> None:
    # The gateway sends the rendered prompt, ending in "Assistant:", alone: the model must have seen exactly
    # those ids at the start of the dialogue it learned, so the answer is what it learned to continue.
    for dialogue in train_tokenizer.dialogue_documents(train_tokenizer.CORPUS_DIR):
        prompt = dialogue[:dialogue.rindex("Assistant:") + len("Assistant:")]
        prompt_ids = demo_sp.encode(prompt)
        assert demo_sp.encode(dialogue)[:len(prompt_ids)] == prompt_ids, prompt


def test_chat_markers_are_whole_pieces(demo_sp: sentencepiece.SentencePieceProcessor) -> None:
    pieces = [demo_sp.id_to_piece(i) for i in demo_sp.encode("System: Be brief.\n\nUser: Hello!\n\nAssistant:")]
    assert pieces[:2] == ["\u2581System", ":"]
    assert pieces[-3:] == ["!\n\n", "Assistant", ":"]
    assert "User" in pieces and ".\n\n" in pieces
    assert not any(demo_sp.is_byte(demo_sp.piece_to_id(p)) for p in pieces)  # no byte fallback for the format
