"""tests.waiting.wait_until: returns what the predicate found, or fails saying what was awaited."""

from __future__ import annotations

import pytest

from tests.waiting import wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    answers = iter([0, [], "found"])
    assert wait_until(lambda: next(answers), timeout=5, interval=0) == "found"


def test_wait_until_fails_with_the_message_computed_at_the_timeout() -> None:
    seen: list[int] = []

    def never() -> bool:
        seen.append(len(seen))
        return False
    with pytest.raises(AssertionError, match=r"checked \d+ times \(waited 0.05 s\)"):
        wait_until(never, timeout=0.05, interval=0.01, message=lambda: f"checked {len(seen)} times")
    assert len(seen) >= 2
