"""Flags read GROK_<SERVICE>_<FLAG> environment variables; the flag wins."""

from __future__ import annotations

import pytest

from serving_common.flags import EnvArgumentParser, port


def make_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(env_prefix="GROK_TEST")
    parser.add_env_argument("--metrics-port", type=port, default=0, help="metrics port")
    parser.add_env_argument("--random-init", action="store_true", help="random weights")
    return parser


def test_env_variable_sets_the_default(monkeypatch) -> None:
    monkeypatch.setenv("GROK_TEST_METRICS_PORT", "9100")
    monkeypatch.setenv("GROK_TEST_RANDOM_INIT", "true")
    args = make_parser().parse_args([])
    assert args.metrics_port == 9100 and args.random_init is True


def test_flag_wins_over_env(monkeypatch) -> None:
    monkeypatch.setenv("GROK_TEST_METRICS_PORT", "9100")
    assert make_parser().parse_args(["--metrics-port", "9200"]).metrics_port == 9200


def test_bad_env_value_is_rejected(monkeypatch) -> None:
    monkeypatch.setenv("GROK_TEST_METRICS_PORT", "70000")
    with pytest.raises(SystemExit):
        make_parser().parse_args([])


def test_help_names_the_env_variable() -> None:
    assert "GROK_TEST_METRICS_PORT" in make_parser().format_help()
