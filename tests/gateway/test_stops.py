"""Unit tests of stop-sequence matching and token-granular release (gateway/stops.py)."""

from __future__ import annotations

from gateway.stops import StopMatcher, find_stop, holdback
from grok.gateway.v1 import gateway_pb2


def tokens(*texts: str) -> list[gateway_pb2.Token]:
    return [gateway_pb2.Token(id=i, text=t) for i, t in enumerate(texts)]


def run(stops: list[str], *texts: str) -> tuple[list[str], bool]:
    """Feed one token at a time; return the texts released per step and whether a stop ended it."""
    matcher, out = StopMatcher(stops), []
    for token in tokens(*texts):
        release = matcher.feed([token])
        out.append(release.text)
        if release.stopped:
            return out, True
    final = matcher.finish()
    out.append(final.text)
    return out, final.stopped


def test_holdback_is_longest_suffix_that_starts_a_stop() -> None:
    assert holdback("abc", ["cde"]) == 1
    assert holdback("abcd", ["cde", "bcdx"]) == 3
    assert holdback("abc", ["xyz"]) == 0
    assert holdback("abc", []) == 0


def test_find_stop_returns_earliest_start() -> None:
    assert find_stop("one two three", ["three", "two"], 0) == 4
    assert find_stop("one two", ["zzz"], 0) == -1


def test_stop_spanning_three_tokens_is_not_emitted_and_ends_generation() -> None:
    out, stopped = run(["lo wor"], "hel", "lo", " w", "orld", "more")
    assert stopped
    assert "".join(out) == "hel"
    assert len(out) == 4  # ended on the token that completed the stop


def test_tokens_fed_together_stop_where_they_would_one_at_a_time() -> None:
    # "c" completes before "abcd" does: one token at a time ends at "ab", and so must one feed of all three.
    one_by_one, stopped = run(["abcd", "c"], "a", "bc", "d")
    assert stopped and "".join(one_by_one) == "ab"
    release = StopMatcher(["abcd", "c"]).feed(tokens("a", "bc", "d", "e"))
    assert release.stopped and release.text == "ab"
    assert release.used == 2  # "d" and "e" came after the stop: not the completion's


def test_text_that_might_start_a_stop_is_held_back_until_it_cannot() -> None:
    out, stopped = run(["abc"], "x", "a", "b", "d")
    assert not stopped
    assert out == ["x", "", "", "abd", ""]


def test_without_stops_every_token_with_text_is_released_at_once() -> None:
    out, _ = run([], "a", "b", "")
    assert out == ["a", "b", "", ""]


def test_trailing_empty_text_tokens_wait_for_the_next_text() -> None:
    matcher = StopMatcher([])
    assert matcher.feed(tokens("a", "")).tokens[-1].text == "a"
    release = matcher.feed(tokens("", "é"))
    assert [t.text for t in release.tokens] == ["", "", "é"]


def test_stop_inside_one_token_trims_that_token() -> None:
    matcher = StopMatcher(["STOP"])
    release = matcher.feed(tokens("ab", "cdSTOPef"))
    assert release.stopped
    assert [t.text for t in release.tokens] == ["ab", "cd"]


def test_earliest_of_several_stops_wins() -> None:
    out, stopped = run(["zz", "b"], "a", "bzz")
    assert stopped and "".join(out) == "a"


def test_flushed_tail_goes_to_last_pending_token_and_can_complete_a_stop() -> None:
    matcher = StopMatcher(["x\ufffd"])
    assert matcher.feed(tokens("a", "x")).text == "a"
    final = matcher.finish("\ufffd")
    assert final.stopped and final.text == ""
    matcher = StopMatcher([])
    assert matcher.feed(tokens("a", "")).text == "a"
    final = matcher.finish("\ufffd")
    assert [t.text for t in final.tokens] == ["\ufffd"] and final.extra == ""
    matcher = StopMatcher([])
    assert matcher.feed(tokens("ab")).text == "ab"
    final = matcher.finish("\ufffd")
    assert final.tokens == [] and final.text == final.extra == "\ufffd"


def test_empty_token_before_the_stop_is_kept_and_one_at_the_stop_is_dropped() -> None:
    matcher = StopMatcher(["é!"])
    release = matcher.feed(tokens("a", "", "é!"))
    assert release.stopped
    assert [t.text for t in release.tokens] == ["a"]


def test_with_include_the_stop_sequence_ends_the_text_and_what_follows_it_is_dropped() -> None:
    matcher = StopMatcher(["lo wor"], include=True)
    released = [matcher.feed([t]) for t in tokens("hel", "lo", " w", "orld!")]
    assert released[-1].stopped and "".join(r.text for r in released) == "hello wor"  # "ld!" is after the stop
    inside = StopMatcher(["c"], include=True).feed(tokens("a", "bcd", "e"))
    assert inside.stopped and inside.text == "abc" and inside.used == 2
    assert StopMatcher(["c"]).feed(tokens("a", "bcd")).text == "ab"  # the default leaves it out


def test_with_include_a_stop_completed_by_the_flushed_tail_is_kept_whole() -> None:
    matcher = StopMatcher(["xyz"], include=True)
    assert matcher.feed(tokens("ab", "x")).text == "ab"  # "x" may start the stop: held back
    final = matcher.finish("yz!")
    assert final.stopped and final.text == "xyz" and matcher.matched == "xyz"


def test_with_min_tokens_a_stop_completed_by_the_first_tokens_is_text_and_a_later_one_ends_it() -> None:
    """vLLM's rule: a stop sequence ends the text only when a token after the first min_tokens completes it; one
    completed earlier stays text (and is not found again), one spanning the boundary counts."""
    matcher = StopMatcher(["ab"], min_tokens=2)
    released = [matcher.feed([t]) for t in tokens("xa", "b", "a", "b!")]
    assert [r.stopped for r in released] == [False, False, False, True]
    assert "".join(r.text for r in released) == "xab"
    spanning = StopMatcher(["ab"], min_tokens=2)
    assert [spanning.feed([t]).stopped for t in tokens("x", "a", "b")] == [False, False, True]
    tail = StopMatcher(["ab"], min_tokens=1)
    assert not tail.feed(tokens("a")).stopped
    assert not tail.finish("b").stopped  # the flush belongs to the first token: still within min_tokens


def test_a_turn_start_stops_alongside_the_requests_stops_and_is_never_part_of_the_text() -> None:
    matcher = StopMatcher(["zz"], include=True, turn_starts=["\n\nUser:"])
    assert matcher.feed(tokens("hi", "\n\n", "User", ":", " more")).text == "hi" and matcher.stopped
    assert matcher.matched == "\n\nUser:"
    matcher = StopMatcher(["zz"], include=True, turn_starts=["\n\nUser:"])
    assert matcher.feed(tokens("hi", "z", "z", "\n\nUser:")).text == "hizz" and matcher.matched == "zz"
