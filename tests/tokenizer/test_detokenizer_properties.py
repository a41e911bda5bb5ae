"""Property tests of the incremental detokenizer with the real Grok-1 tokenizer.

Whatever the text or id stream and however it is chunked: the deltas (plus the final flush)
concatenate to exactly `sentencepiece.decode` of all ids, every emitted prefix is a prefix of that
final text (so no U+FFFD is ever emitted for a character that later completes), per-token texts
concatenate to their delta, and nothing is held back once a non-byte piece arrives.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving_common.detokenizer import REPLACEMENT
from tokenizer_service.tokenizer import Tokenizer

PROPERTY_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SPECIAL_CHARS = [" ", "\t", "\n", REPLACEMENT, "\u200d", "\ufeff", "\u00a0", "\u3000", "e\u0301"]
WHITESPACE_RUNS = ["  ", "   ", "    ", "\n\n", " \n ", "\t\t"]
characters = st.one_of(
    st.characters(codec="utf-8"),
    st.sampled_from(SPECIAL_CHARS),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(min_codepoint=0x0300, max_codepoint=0x036F),  # combining marks
    st.characters(min_codepoint=0x20, max_codepoint=0x7E),
)
# A random leading run of spaces, then characters and whitespace runs.
texts = st.tuples(st.sampled_from(["", " ", "  "]),
                  st.lists(st.one_of(characters, st.sampled_from(WHITESPACE_RUNS)), max_size=30)).map(
    lambda parts: parts[0] + "".join(parts[1]))


def check_stream(tok: Tokenizer, ids: list[int], chunks: list[int]) -> None:
    """Feed `ids` in chunks of the given sizes and check every property against sentencepiece."""
    final = tok.sp.decode(ids)
    decoder = tok.stream_decoder()
    emitted, start = "", 0
    for size in [*chunks, len(ids)]:
        chunk = ids[start:start + size]
        if not chunk and start >= len(ids):
            break
        token_texts = decoder.push_many(chunk)
        assert len(token_texts) == len(chunk)
        delta = "".join(token_texts)
        start += len(chunk)
        emitted += delta
        assert final.startswith(emitted), (ids, start, emitted, final)
        so_far = tok.sp.decode(ids[:start])
        assert so_far.startswith(emitted)
        assert len(so_far) - len(emitted) <= 3  # only an incomplete character's bytes are held back
        if chunk and tok.byte_value[chunk[-1]] < 0:
            assert emitted == so_far
    emitted += decoder.flush()
    assert emitted == final


@PROPERTY_SETTINGS
@given(text=texts)
def test_token_by_token_stream_equals_decode(grok_tokenizer: Tokenizer, text: str) -> None:
    ids = grok_tokenizer.encode(text)
    check_stream(grok_tokenizer, ids, [1] * len(ids))
    if REPLACEMENT not in text:
        decoder = grok_tokenizer.stream_decoder()
        assert all(REPLACEMENT not in decoder.push(i) for i in ids)
        assert REPLACEMENT not in decoder.flush()


@PROPERTY_SETTINGS
@given(text=texts, data=st.data())
def test_randomly_chunked_stream_equals_decode(grok_tokenizer: Tokenizer, text: str, data: st.DataObject) -> None:
    ids = grok_tokenizer.encode(text)
    chunks = data.draw(st.lists(st.integers(0, 6), max_size=len(ids) + 2))
    check_stream(grok_tokenizer, ids, chunks)


def special_ids(tok: Tokenizer) -> list[int]:
    """Control and unknown ids, and pieces that test where decode drops a leading space."""
    return [tok.sp.pad_id(), tok.sp.bos_id(), tok.sp.eos_id(), tok.sp.unk_id(), tok.sp.piece_to_id("▁"),
            tok.sp.piece_to_id("▁▁"), tok.sp.piece_to_id("▁hello"), tok.sp.piece_to_id("world")]


def id_segments(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Pieces of an id stream: whole or cut UTF-8 characters as byte pieces, stray bytes, specials."""
    byte_id = {b: i for i, b in enumerate(tok.byte_value) if b >= 0}

    def as_bytes(data: bytes) -> list[int]:
        return [byte_id[b] for b in data]

    encoded_char = st.characters(codec="utf-8").map(lambda c: as_bytes(c.encode()))
    cut_char = st.characters(min_codepoint=0x80, codec="utf-8").flatmap(
        lambda c: st.integers(1, len(c.encode()) - 1).map(lambda n: as_bytes(c.encode()[:n])))
    specials = special_ids(tok)
    return st.one_of(
        encoded_char, encoded_char, cut_char,
        st.lists(st.sampled_from(sorted(byte_id.values())), min_size=1, max_size=4),
        st.sampled_from(specials).map(lambda i: [i]),
        st.integers(0, tok.vocab_size - 1).map(lambda i: [i]),
    )


@PROPERTY_SETTINGS
@given(data=st.data())
def test_random_id_streams_equal_decode(grok_tokenizer: Tokenizer, data: st.DataObject) -> None:
    # The start of a stream matters most (leading-space rules), so it often begins with special ids.
    head = data.draw(st.lists(st.sampled_from(special_ids(grok_tokenizer)), max_size=3))
    segments = data.draw(st.lists(id_segments(grok_tokenizer), max_size=12))
    ids = head + [i for segment in segments for i in segment]
    chunks = data.draw(st.one_of(st.just([1] * len(ids)), st.lists(st.integers(0, 5), max_size=len(ids) + 2)))
    check_stream(grok_tokenizer, ids, chunks)
