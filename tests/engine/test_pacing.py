"""Pacing: the prompt rows a step may take while streams decode, from the step times measured so far."""

from __future__ import annotations

import math

import pytest

from model_service.pacing import DEFAULT_SLOWDOWN, MIN_ROWS, Pacing, chunk_rows
from model_service.plan import Chunk, Policy, Sample, View, schedule


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


def test_a_steps_fixed_part_is_told_apart_from_its_rows() -> None:
    """A step with prompt rows that costs a part of its own whatever its rows (a TPU: starting slots, the prompt
    rows' attention; ~5 ms of a 6 ms decode step): priced by rows alone, one 32-row prompt made a row look worth
    ~0.2 ms and the budget one prompt a step, each step paying the fixed part again. Told apart, a mixed step
    carries the rows that cost as much as its fixed part, since the fixed part alone takes the allowance."""
    decode, fixed, row = 0.006, 0.005, 0.00005
    pacing = Pacing(initial=16, ceiling=1024)
    for _ in range(5):
        pacing.observe(decode, decoding=True, prompt_cost=0)
    for cost in (32, 64, 32, 96, 64, 32, 128):
        pacing.observe(decode + fixed + row * cost, decoding=True, prompt_cost=cost)
    assert pacing.fixed == pytest.approx(fixed) and pacing.per_row == pytest.approx(row)
    assert (DEFAULT_SLOWDOWN - 1) * decode < fixed
    assert pacing.budget() == pytest.approx(fixed / row)  # 100 rows: three 32-token prompts a step, not one
    ratio_only = Pacing(initial=16, ceiling=1024, decode=decode)
    ratio_only.observe(decode + fixed + row * 32, decoding=True, prompt_cost=32)
    assert ratio_only.budget() < 32  # one step: no line yet, the ratio (the model before the fixed part)


def test_a_fixed_part_within_the_allowance_leaves_the_rest_to_rows() -> None:
    decode, fixed, row = 0.030, 0.004, 0.0005
    pacing = Pacing(initial=16, ceiling=512)
    pacing.observe(decode, decoding=True, prompt_cost=0)
    for cost in (8, 40, 16, 24, 40):
        pacing.observe(decode + fixed + row * cost, decoding=True, prompt_cost=cost)
    rows = pacing.budget()
    assert rows == pytest.approx(((DEFAULT_SLOWDOWN - 1) * decode - fixed) / row)  # 40 rows
    assert decode + fixed + row * rows == pytest.approx(DEFAULT_SLOWDOWN * decode)  # still the step aimed at


def test_rows_that_all_cost_alike_tell_no_fixed_part() -> None:
    pacing = Pacing(initial=16, ceiling=512)
    pacing.observe(0.030, decoding=True, prompt_cost=0)
    for _ in range(6):
        pacing.observe(0.030 + 0.004 + 40 * 0.0005, decoding=True, prompt_cost=40)
    assert pacing.fixed == 0 and pacing.per_row == pytest.approx((0.004 + 40 * 0.0005) / 40)


def test_a_few_steps_or_noisy_ones_tell_no_fixed_part() -> None:
    """A long prompt's first two chunks are its only rows-alone steps (a 2-core CPU, its jitter on each): any two
    points fit a line, which priced its later chunks' keys too cheaply and let its steps run past the allowance.
    A fixed part is told only from several steps that a line explains; otherwise the rows' ratio prices them."""
    decode = 0.023
    pacing = Pacing(initial=16, ceiling=64, decode=decode)
    pacing.observe(decode + 16 * 0.0015 + 0.004, decoding=True, prompt_cost=16)  # jitter on the first
    pacing.observe(decode + 9 * 0.0015, decoding=True, prompt_cost=9)
    assert pacing.fixed == 0
    noisy = Pacing(initial=16, ceiling=64, decode=decode)
    for cost, jitter in ((8, 0.006), (16, -0.004), (12, 0.005), (24, -0.006), (8, -0.003), (20, 0.006)):
        noisy.observe(decode + 0.002 + cost * 0.0005 + jitter, decoding=True, prompt_cost=cost)
    assert noisy.fixed == 0


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


# Measured on a 2-core CPU (medium at context 8,192, float32, 4 decode rows and one prompt chunk at position
# ~3,000): a decode-only step 17.9 ms; any prompt rows ~8 ms for their sequence's keys plus ~1.45 ms a row.
DECODE, KEY, ROW = 0.0179, 0.008 / 3000, 0.00145


def step_seconds(start: int, rows: int) -> float:
    """A step of four decodes and `rows` prompt rows from `start`, by that measurement (row cost flat: scale inf)."""
    return DECODE + (KEY * start if rows else 0.0) + ROW * rows


def paced_chunk(pacing: Pacing, start: int, length: int = 6000) -> Chunk:
    """The chunk the plan gives a prompt at `start` beside four streams that were decoding before it arrived, under
    the policy the scheduler builds from `pacing`."""
    streams = tuple(Sample((i, 0), i, 99, 100, decoding_since=0.0) for i in range(4))
    prompt = Sample((9, 0), 4, start, length, arrived=1.0)
    policy = Policy(64, pacing.budget(), math.inf, 8, pacing.keys_per_row(), pacing.min_rows)
    return schedule(View((), (*streams, prompt), frozenset()), policy).chunks[-1]


def run_prompt(pacing: Pacing, start: int, end: int) -> list[float]:
    """A prompt's rows start .. end computed beside the streams, paced as the scheduler paces them: each step's
    time (by the measurement above) fed back to `pacing`."""
    seconds = []
    while start < end:
        chunk = paced_chunk(pacing, start, end)
        seconds.append(step_seconds(chunk.start, chunk.rows))
        pacing.observe(seconds[-1], decoding=True, prompt_cost=chunk.rows, prompt_keys=chunk.start)
        start += chunk.rows
    return seconds


def test_a_prompt_chunks_keys_are_priced_apart_from_its_rows() -> None:
    """Issue 64.8: a chunk's sequence has its keys read once a step, whatever its rows. Priced by rows alone, a
    long prompt's steps at position ~3,000 taught the pacing that a row costs ~3 ms, and a new prompt at position
    0 then got 4 rows a step (the floor) where the allowance pays for 9; priced apart, each gets what the allowance
    pays for."""
    pacing = Pacing(initial=16, ceiling=64)
    for _ in range(10):
        pacing.observe(DECODE, decoding=True, prompt_cost=0)
    run_prompt(pacing, 0, 3000)
    assert pacing.per_key == pytest.approx(KEY, rel=1e-6) and pacing.per_row == pytest.approx(ROW, rel=1e-6)
    allowance = (DEFAULT_SLOWDOWN - 1) * DECODE  # what a step may add to the decode: 14.3 ms
    for start in (0, 1000, 3000):
        rows = paced_chunk(pacing, start).rows
        assert rows == int((allowance - KEY * start) / ROW), start  # 9, 8 and 4 rows
        assert step_seconds(start, rows) <= DEFAULT_SLOWDOWN * DECODE < step_seconds(start, rows + 1)


def test_where_the_keys_alone_take_the_allowance_a_prompt_still_gets_its_floor_of_rows() -> None:
    pacing = Pacing(initial=16, ceiling=64, decode=DECODE, per_row=ROW, per_key=KEY, rows_alone=True)
    assert KEY * 5800 > (DEFAULT_SLOWDOWN - 1) * DECODE  # the keys' read alone is over the allowance there
    assert paced_chunk(pacing, 5800).rows == MIN_ROWS


def test_a_long_prompt_paced_by_what_its_steps_cost_keeps_each_step_within_the_allowance() -> None:
    pacing = Pacing(initial=16, ceiling=64)
    for _ in range(10):
        pacing.observe(DECODE, decoding=True, prompt_cost=0)
    seconds = run_prompt(pacing, 0, 4000)
    floor_steps = [s for s in seconds[3:] if s > DEFAULT_SLOWDOWN * DECODE * 1.001]
    # Past the first steps (the estimates settling) only steps at the floor, where the keys' read alone is over
    # the allowance, take longer.
    assert all(s <= step_seconds(start=4000, rows=int(MIN_ROWS)) for s in floor_steps)
    assert len(seconds) < 4000 / MIN_ROWS


def test_noise_on_a_step_with_few_keys_does_not_price_every_later_key() -> None:
    """A prompt's second chunk holds only the first chunk's keys: a few milliseconds of the box's noise on that
    step, divided by its 16 keys, would price a key at 20 times its cost and hold the prompt at its floor."""
    pacing = Pacing(initial=16, ceiling=64, decode=DECODE)
    pacing.observe(step_seconds(0, 16), decoding=True, prompt_cost=16)  # rows alone: per_row measured
    pacing.observe(step_seconds(16, 9) + 0.005, decoding=True, prompt_cost=9, prompt_keys=16)
    for start in range(25, 625, 60):
        pacing.observe(step_seconds(start, 8), decoding=True, prompt_cost=8, prompt_keys=start)
    assert pacing.per_key == pytest.approx(KEY, rel=0.2)


def test_on_these_costs_no_pacing_keeps_every_step_within_2x_without_slowing_the_prompt() -> None:
    """docs/reliability.md (64.8): past position ~4,800 one row's step is over 1.8x the decode, the 4-row floor
    reaches 2.2x, and capping every step at 2x (one row at least) costs the 6,000-token prompt ~52 s of steps
    against ~42 s, before any of the box's own jitter."""
    assert (DEFAULT_SLOWDOWN - 1) * DECODE - ROW == pytest.approx(KEY * 4826, rel=1e-3)

    def prompt(pacing: Pacing) -> list[float]:
        for _ in range(10):
            pacing.observe(DECODE, decoding=True, prompt_cost=0)
        return run_prompt(pacing, 0, 6000)

    paced, capped = prompt(Pacing(16, 64)), prompt(Pacing(16, 64, slowdown=2.0, min_rows=1))
    # (the first step, of `initial` rows, comes before anything is measured)
    assert max(paced[1:]) / DECODE == pytest.approx(2.22, abs=0.01) and sum(paced) == pytest.approx(42, abs=0.5)
    assert max(capped[1:]) / DECODE <= 2.0 and sum(capped) == pytest.approx(52, abs=0.5)
