"""benchmarks.closed_loop: the in-process engine under closed-loop clients that wait between requests, per policy,
and its step probe (golden checkpoint, CPU)."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks import closed_loop


def test_dead_time_is_drawn_around_its_mean_and_repeatable() -> None:
    async def inner(request: int) -> int:
        return request

    async def main(seed: int) -> list[float]:
        send = closed_loop.DeadTimeSender(inner, 0.0005, seed)
        slept: list[float] = []
        real = asyncio.sleep

        async def record(seconds: float) -> None:
            slept.append(seconds)
            await real(0)

        asyncio.sleep = record  # type: ignore[assignment]
        try:
            assert [await send(i) for i in range(200)] == list(range(200))
        finally:
            asyncio.sleep = real  # type: ignore[assignment]
        return slept

    waits = asyncio.run(main(1))
    assert waits == asyncio.run(main(1)) and waits != asyncio.run(main(2))
    assert all(0 <= w <= 0.001 for w in waits) and 0.0004 < sum(waits) / len(waits) < 0.0006


def test_policies_and_the_step_probe_on_the_golden_engine(tmp_path, capsys) -> None:
    out = tmp_path / "closed.json"
    assert closed_loop.main(["--stack", "golden", "--concurrency", "4", "--dead-ms", "0,2", "--slowdown", "1.8",
                             "--prefill-rows", "8", "--num-prompts", "12", "--runs", "1", "--step-probe",
                             "--probe-prompts", "1", "--input-len", "16", "--output-len", "4",
                             "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["stack"]["dtype"] == "float32"  # --dtype's default, as the model service's
    names = [p["name"] for p in saved["step_probe"]]
    assert names[0] == "decode-3" and "mixed-3+1x16-start" in names and "mixed-3+1x16-no-start" in names
    assert "start-1" in names and all(p["ms"] > 0 for p in saved["step_probe"])
    points = saved["points"]
    assert {(p["policy"], p["dead_ms"]) for p in points} == {("slowdown", 0.0), ("slowdown", 2.0),
                                                              ("prefill_rows", 0.0), ("prefill_rows", 2.0)}
    assert all(p["completed"] == 12 and p["failed"] == 0 and p["total_output_tokens"] == 12 * 4 for p in points)
    assert all(p["steps_decode"] + p["steps_mixed"] + p["steps_prompt"] > 0 for p in points)
    summary = json.loads(capsys.readouterr().out)
    assert len(summary) == 4 and summary[0]["throughput_ratio"] == 1.0
