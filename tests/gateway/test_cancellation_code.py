"""A call cancelled at its deadline is counted and logged as DEADLINE_EXCEEDED even when gRPC's timer fires a
hair before the handler's clock reaches it; a client's cancel stays CANCELLED."""

from __future__ import annotations

import pytest

from gateway.servicer import cancellation_code


@pytest.mark.parametrize("left, code", [
    (-0.5, "DEADLINE_EXCEEDED"),
    (0.0, "DEADLINE_EXCEEDED"),
    (0.0004, "DEADLINE_EXCEEDED"),  # gRPC's timer fired first (seen: 1,002 ms into a 1 s call)
    (0.5, "CANCELLED"),  # the client cancelled well before its deadline
    (None, "CANCELLED"),  # no deadline at all
])
def test_a_cancelled_call_ends_with_its_deadline_or_the_clients_cancel(left: float | None, code: str) -> None:
    assert cancellation_code(left) == code
