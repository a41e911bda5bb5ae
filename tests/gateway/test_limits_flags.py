"""The gateway's limits: each is a flag (max_top_logprobs too), each flag's default is the one declaration in
gateway/config.Limits, and a cap above what the model computes is refused naming the flag."""

from __future__ import annotations

import pytest

from gateway.__main__ import parse_config
from gateway.config import Limits

REQUIRED = ["--tokenizer", "127.0.0.1:1", "--model", "127.0.0.1:2"]


def test_every_limit_flag_defaults_to_the_declared_default() -> None:
    assert parse_config(REQUIRED).limits == Limits()


def test_max_top_logprobs_is_a_flag_that_lowers_the_cap() -> None:
    assert parse_config(REQUIRED + ["--max-top-logprobs", "3"]).limits.max_top_logprobs == 3


def test_max_top_logprobs_above_the_models_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(REQUIRED + ["--max-top-logprobs", "21"])
    assert "--max-top-logprobs: must be in 0..20" in capsys.readouterr().err
