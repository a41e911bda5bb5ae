"""Token texts in context, property-tested on random id sequences of both tokenizers (the demo's and Grok-1's).

The rule (docs/api.md): a completion's text is what the prompt's text lacks, so that
`decode(prompt) + completion_text == decode(prompt + completion)`; each token's text is what it adds to
the text before it, and each alternative's text is what it would have added in the chosen token's place.
SentencePiece drops a piece's leading space only at the very start of a text, so after a prompt the first
generated piece keeps it (" large", not "large"). The tokenizer itself (the service) and its piece table
(the gateway's --detokenize local) must give the same texts.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving_common.detokenizer import PieceTable, StreamDecoder, TokenizerInputError
from tests.procs import GROK1_TOKENIZER, ROOT
from tests.tokenizer.test_detokenizer_properties import id_segments, special_ids
from tokenizer_service.tokenizer import Tokenizer

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MODELS = {"demo": ROOT / "demo" / "tokenizer.model", "grok1": GROK1_TOKENIZER}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return Tokenizer(MODELS[request.param])


@pytest.fixture(scope="module")
def table(tok: Tokenizer) -> PieceTable:
    return tok.piece_table()


def id_sequences(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Random id sequences: specials at the start (where the leading-space rule acts), then encoded text,
    byte runs (whole and cut characters), specials and any id."""
    head = st.lists(st.sampled_from(special_ids(tok)), max_size=2)
    text = st.text(alphabet=st.sampled_from(list(" abcdeThe\n\u00e9\u4e2d\U0001f600")), max_size=12).map(tok.encode)
    body = st.lists(st.one_of(id_segments(tok), text), max_size=8)
    return st.tuples(head, body).map(lambda parts: parts[0] + [i for segment in parts[1] for i in segment])


def settled(decoder: StreamDecoder, ids: list[int]) -> str:
    """The text a decoder returns for `ids` (what is still held back excluded)."""
    return "".join(decoder.push_many(ids))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_first_generated_piece_keeps_its_space_after_the_prompt(model: str) -> None:
    tok = Tokenizer(MODELS[model])
    ids = tok.encode("The gateway limits the prompt")
    prompt, completion = ids[:2], ids[2:]
    assert tok.decode(completion[:1]) == "lim" if model == "demo" else "limits"  # decoded alone: no space
    for pieces in (tok, tok.piece_table()):
        decoder = pieces.stream_decoder()
        decoder.prime(prompt)
        texts = decoder.push_many(completion)
        assert texts[0] == (" lim" if model == "demo" else " limits")
        assert tok.decode(prompt) + "".join(texts) + decoder.flush() == tok.decode(prompt + completion)


def test_priming_after_an_id_was_pushed_is_refused(tok: Tokenizer) -> None:
    decoder = tok.stream_decoder()
    decoder.push(tok.encode("a")[0])
    with pytest.raises(TokenizerInputError, match="before the first generated id"):
        decoder.prime(tok.encode("b"))


@SETTINGS
@given(data=st.data())
def test_prompt_text_plus_streamed_deltas_equals_decode_of_all_ids(tok: Tokenizer, table: PieceTable,
                                                                  data: st.DataObject) -> None:
    ids = data.draw(id_sequences(tok))
    split = data.draw(st.integers(0, len(ids)))
    prompt, completion = ids[:split], ids[split:]
    for pieces in (tok, table):
        decoder = pieces.stream_decoder()
        decoder.prime(prompt)
        held = decoder.pending
        deltas = [decoder.push(i) for i in completion]
        tail = decoder.flush()
        # What the prompt's ids settle on their own, followed by the deltas, is the decode of every id.
        assert settled(pieces.stream_decoder(), prompt) + "".join(deltas) + tail == tok.decode(ids)
        if not held:  # a prompt encoded from text never ends inside a character
            assert tok.decode(prompt) + "".join(deltas) + tail == tok.decode(ids)


@SETTINGS
@given(data=st.data())
def test_each_token_and_alternative_text_is_its_text_in_context(tok: Tokenizer, table: PieceTable,
                                                                data: st.DataObject) -> None:
    ids = data.draw(id_sequences(tok))
    split = data.draw(st.integers(0, len(ids)))
    any_id = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(special_ids(tok)))
    alternatives = data.draw(st.lists(st.lists(any_id, max_size=3), min_size=len(ids) - split,
                                      max_size=len(ids) - split))
    results = []
    for pieces in (tok, table):
        decoder = pieces.stream_decoder()
        decoder.prime(ids[:split])
        results.append(decoder.push_with_alternatives(ids[split:], alternatives))
    assert results[0] == results[1]  # the service and the gateway's local detokenizer agree
    texts, others = results[0]
    for step, (token_texts, chosen) in enumerate(zip(others, texts)):
        before = ids[:split + step]
        if held_back(tok, before):
            continue  # only a byte piece finishing the character has text there: checked by the property above
        for other, text in zip(alternatives[step], token_texts):
            if not held_back(tok, before + [other]):
                assert tok.decode(before) + text == tok.decode(before + [other])
        if not held_back(tok, before + [ids[split + step]]):
            assert tok.decode(before) + chosen == tok.decode(before + [ids[split + step]])
        assert ids[split + step] not in alternatives[step] or chosen in token_texts  # the chosen one reads alike


def held_back(tok: Tokenizer, ids: list[int]) -> bool:
    decoder = tok.stream_decoder()
    decoder.push_many(ids)
    return decoder.pending


@SETTINGS
@given(data=st.data())
def test_peeking_at_alternatives_leaves_the_stream_unchanged(tok: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(id_sequences(tok))
    others = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=len(ids), max_size=len(ids)))
    plain = tok.stream_decoder()
    peeking = tok.stream_decoder()
    for token_id, other in zip(ids, others):
        peeking.peek(other)
        assert peeking.push(token_id) == plain.push(token_id)
    assert peeking.flush() == plain.flush()
