"""benchmarks.schedule_sim: the scheduling policy (plan.py, pacing.py) against a modelled accelerator's step costs."""

from __future__ import annotations

import json

import pytest

from benchmarks import schedule_sim


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    assert schedule_sim.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)["results"]


def test_a_step_costs_the_least_bucket_holding_its_rows() -> None:
    buckets = (16, 64, 128)
    assert [schedule_sim.bucket(r, buckets) for r in (1, 16, 17, 64, 65, 128)] == [16, 16, 64, 64, 128, 128]


def test_rounds_sent_together_run_as_the_in_process_engine_does(capsys: pytest.CaptureFixture[str]) -> None:
    # 4 rounds of 64 requests x 32 prompt tokens (2,048 rows: two 1,024-row steps each) and 32 tokens out
    (res,) = run(capsys, "--burst", "--concurrency", "64", "--requests", "256")
    steps = res["steps"]
    assert steps["prompt"] == 4  # each round's first prompt step: nothing decodes yet
    assert steps["mixed"] + steps["prompt"] == 4 * 3  # the second prompt step and the pipelined ones beside it
    assert res["tokens_per_step"] == pytest.approx(256 * 32 / sum(steps.values()))
    assert res["step_ms"]["decode"] == pytest.approx(schedule_sim.FIXED_MS + schedule_sim.ROW_MS * 64, rel=0.01)


def test_every_request_ends_and_the_run_is_repeatable(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--concurrency", "8", "--requests", "40", "--client-spread-ms", "5", "--seed", "3")
    first, again = run(capsys, *argv), run(capsys, *argv)
    assert first == again
    assert first[0]["requests"] == 40 and first[0]["tokens"] == 40 * 32
    assert first[0]["tokens"] <= 8 * sum(first[0]["steps"].values())  # a step draws for at most the 8 streams


def test_a_tighter_pacing_budget_spreads_the_prompts_over_more_steps(capsys: pytest.CaptureFixture[str]) -> None:
    # the policy is what is modelled: prompts held to a 5 % slowdown enter a few at a time, beside fewer streams
    tight, loose = run(capsys, "--decode-slowdown", "1.05,4", "--client-spread-ms", "20", "--requests", "256")
    assert tight["steps"]["mixed"] > loose["steps"]["mixed"]
    assert tight["tokens"] == loose["tokens"] and sum(tight["steps"].values()) > sum(loose["steps"].values())


def test_what_prompt_rows_and_slot_starts_add_to_a_step_is_modelled(capsys: pytest.CaptureFixture[str]) -> None:
    # rounds: each round's first step only computes prompts and starts every slot; its decode steps neither
    (plain,) = run(capsys, "--burst", "--concurrency", "64", "--requests", "128")
    (dear,) = run(capsys, "--burst", "--concurrency", "64", "--requests", "128", "--prompt-ms", "3", "--start-ms", "2")
    assert dear["step_ms"]["decode"] == pytest.approx(plain["step_ms"]["decode"])
    assert dear["step_ms"]["prompt"] == pytest.approx(plain["step_ms"]["prompt"] + 5.0)
