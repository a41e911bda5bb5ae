"""benchmarks.pipeline_cost runs the gateway's servicer over a replay replica and reports its CPU per token."""

from __future__ import annotations

import json

import pytest

from benchmarks import pipeline_cost


def test_it_relays_every_token_and_prints_its_cost(capsys: pytest.CaptureFixture[str]) -> None:
    assert pipeline_cost.main(["--streams", "3", "--tokens", "12", "--runs", "2", "--stop", "zzz-never"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["streams"] == 3 and len(out["cpu_us_per_token"]) == 2
    assert out["cpu_us_per_token_median"] > 0


def test_more_tokens_than_its_text_encodes_to_is_refused() -> None:
    with pytest.raises(SystemExit, match="encodes to only"):
        pipeline_cost.run(2, 10**7, 1, (), 0, pipeline_cost.DEFAULT_TOKENIZER)
