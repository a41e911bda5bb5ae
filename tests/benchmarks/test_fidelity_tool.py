"""benchmarks.fidelity: the report's fields, and on CPU what the faithful mode promises there (float32 logits within
1e-4 of the reference's, the transcendentals within a few ulps); on a TPU the same tool showed the chip's own."""

from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks import fidelity


def test_the_report_on_cpu(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fidelity.json"
    assert fidelity.main(["--configs", "exact-unroll", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert set(report["transcendentals"]) == set(fidelity.functions())
    for name, error in report["transcendentals"].items():
        assert error["max_ulp"] < 10, name  # XLA:CPU's forms, accurate or not
    gold = report["golden_float32"]["exact-unroll"]
    for p in range(4):
        assert gold[f"dense_p{p}"]["max"] < 1e-4 and gold[f"dense_p{p}"]["first_past_2e-3"] is None
    assert max(gold["prefill_last"]) < 1e-4


def test_an_unknown_configuration_is_refused_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        fidelity.main(["--configs", "fast"])
    assert done.value.code == 2
    assert "exact-scan" in capsys.readouterr().err
