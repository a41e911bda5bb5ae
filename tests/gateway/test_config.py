"""`python -m gateway` flags and GROK_GATEWAY_* environment variables (the flag wins)."""

from __future__ import annotations

import pytest

from gateway.__main__ import parse_config, split_models


def test_environment_supplies_flags_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROK_GATEWAY_TOKENIZER", "tok:50052")
    monkeypatch.setenv("GROK_GATEWAY_MODEL", "m1:50053, m2:50053")
    monkeypatch.setenv("GROK_GATEWAY_MAX_STOP", "3")
    monkeypatch.setenv("GROK_GATEWAY_PORT", "6000")
    config = parse_config(["--port", "7000", "--default-max-tokens", "5"])
    assert config.tokenizer == "tok:50052"
    assert config.models == ("m1:50053", "m2:50053")
    assert config.port == 7000
    assert config.limits.max_stop == 3 and config.limits.default_max_tokens == 5


def test_missing_model_address_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GROK_GATEWAY_MODEL", raising=False)
    with pytest.raises(SystemExit) as caught:
        parse_config(["--tokenizer", "t:1"])
    assert caught.value.code == 2
    with pytest.raises(SystemExit):
        parse_config(["--tokenizer", "t:1", "--model", " , "])


def test_ipv4_target_stays_one_channel() -> None:
    assert split_models("ipv4:10.0.0.1:50053,10.0.0.2:50053") == ("ipv4:10.0.0.1:50053,10.0.0.2:50053",)
    assert split_models("a:1,b:2") == ("a:1", "b:2")
    assert split_models("dns:///model:50053") == ("dns:///model:50053",)
