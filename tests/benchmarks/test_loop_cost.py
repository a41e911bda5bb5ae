"""benchmarks.loop_cost drives both of the servicer's paths to the end and counts every token it was sent."""

from __future__ import annotations

import pytest

from benchmarks import loop_cost


@pytest.mark.parametrize("path", ["many", "call"])
def test_loop_cost_receives_every_token_of_every_request(path: str) -> None:
    result = loop_cost.measure(path, requests=4, tokens=3, rounds=2)
    assert (result["path"], result["requests"], result["tokens"]) == (path, 4, 3)
    rounds = result["per_round"]
    assert isinstance(rounds, list) and len(rounds) == 2 and all(r > 0 for r in rounds)
    assert result["loop_cpu_ms_per_token"] == rounds[1]  # the first round is the warm-up


def test_a_short_count_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    async def short(servicer: object, requests: int, tokens: int) -> int:
        return requests * tokens - 1
    monkeypatch.setattr(loop_cost, "many", short)
    with pytest.raises(RuntimeError, match="received 11 tokens, expected 12"):
        loop_cost.measure("many", requests=4, tokens=3, rounds=1)
