"""Pacing: the prompt rows a step may take while streams decode, from the step times measured so far."""

from __future__ import annotations

import math

import pytest

from model_service.pacing import DEFAULT_SLOWDOWN, MIN_ROWS, Pacing, chunk_rows


def test_a_mixed_step_is_aimed_at_the_decode_step_times_the_slowdown() -> None:
    pacing = Pacing(initial=16, ceiling=512)
    assert pacing.budget() == 16  # nothing measured yet
    for _ in range(20):
        pacing.observe(0.030, decoding=True, prompt_cost=0)  # decode-only steps of 30 ms
    pacing.observe(0.030 + 40 * 0.0005, decoding=True, prompt_cost=40)  # 40 row-equivalents added 20 ms
    rows = pacing.budget()
    assert rows == pytest.approx((DEFAULT_SLOWDOWN - 1) * 0.030 / 0.0005)
    assert 0.030 + rows * 0.0005 == pytest.approx(DEFAULT_SLOWDOWN * 0.030)  # the mixed step it aims at
    smoother = Pacing(initial=16, ceiling=512, slowdown=1.3, decode=0.030, per_row=0.0005)
    assert 0.030 + smoother.budget() * 0.0005 == pytest.approx(1.3 * 0.030)  # --decode-slowdown 1.3


def test_prompts_still_progress_when_a_row_costs_more_than_the_allowance() -> None:
    pacing = Pacing(initial=16, ceiling=512)
    pacing.observe(0.030, decoding=True, prompt_cost=0)
    pacing.observe(0.030 + 4 * 0.020, decoding=True, prompt_cost=4)  # a row costs 20 ms: the floor binds
    assert pacing.budget() == MIN_ROWS


def test_steps_without_decoding_rows_teach_nothing() -> None:
    pacing = Pacing(initial=16, ceiling=8)
    pacing.observe(5.0, decoding=False, prompt_cost=100)
    assert pacing.decode is None and pacing.budget() == 8  # the ceiling caps the initial rows too


def test_rows_far_into_a_prompt_cost_more_of_the_budget() -> None:
    assert chunk_rows(0, 100, budget=10, scale=math.inf) == 10  # a row with no keys to read costs one
    assert chunk_rows(1000, 5000, budget=10, scale=1000) == 4  # each row costs ~2 row-equivalents
    assert chunk_rows(95, 100, budget=10, scale=math.inf) == 5  # no further than the prompt's end
    assert chunk_rows(4000, 5000, budget=0.5, scale=1000) == 1  # always at least one



def test_the_slowdown_is_a_flag_and_an_environment_variable_and_must_exceed_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from model_service.__main__ import parser

    base = ["--config", "grok-1"]
    assert parser().parse_args(base).decode_slowdown == DEFAULT_SLOWDOWN
    assert parser().parse_args([*base, "--decode-slowdown", "1.25"]).decode_slowdown == 1.25
    monkeypatch.setenv("GROK_MODEL_DECODE_SLOWDOWN", "3")
    assert parser().parse_args(base).decode_slowdown == 3.0
    for bad in ("1", "0.5", "fast"):
        with pytest.raises(SystemExit):
            parser().parse_args([*base, "--decode-slowdown", bad])
