"""The one way tests wait for something to become true: poll a predicate until it holds or time runs out.

`wait_until` returns the predicate's first truthy value, so a wait can hand back what it found; on
timeout it raises AssertionError with `message` (or what `message()` says then: logs, counters),
which is what a failing test should say. Prefer an event (a threading.Event, a future, a log line
the code under test writes) where the code offers one; poll only what has no event to wait on
(another process's state, a port, a health status).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
Message = str | Callable[[], str]


def wait_until(predicate: Callable[[], T], timeout: float = 5.0, interval: float = 0.01,
               message: Message = "the condition did not become true") -> T:
    """`predicate()`'s first truthy value, checked every `interval` s for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message() if callable(message) else message} (waited {timeout} s)")
        time.sleep(interval)

