"""Loading builds the Engine without compiling it; each way of starting compiles every program exactly once."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from model_service.distributed import DistributedConfig, group
from model_service.engine import Engine
from model_service.loading import build_engine, load_engine, resolve
from tests.distributed.fakes import RecordingEngine, SwitchableChannel
from tests.engine.conftest import golden_server_config


def compiled(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.getMessage() == "compiled all programs" for r in caplog.records)


def test_load_engine_does_not_compile_and_build_engine_compiles_once(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    compiles: list[Engine] = []
    monkeypatch.setattr(Engine, "compile", lambda self: compiles.append(self) or {"fake": 0.0})
    config = golden_server_config(slots=2)
    cfg = resolve(config)
    with caplog.at_level(logging.INFO, logger="model_service.loading"):
        assert isinstance(load_engine(config, cfg), Engine)
        assert compiles == [] and compiled(caplog) == 0
        engine = build_engine(config, cfg)
    assert compiles == [engine] and compiled(caplog) == 1


def test_process_0_of_a_group_compiles_once_through_the_lockstep_op(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    loaded = RecordingEngine()
    monkeypatch.setattr(group, "load_engine", lambda *args: loaded)
    monkeypatch.setattr(group, "verify_same_config", lambda *args: None)  # needs jax.distributed
    monkeypatch.setattr(group, "leader_channel", lambda dist: SwitchableChannel())  # a broadcast to nobody
    config = golden_server_config(distributed=DistributedConfig("127.0.0.1:1", 2, 0))
    cfg = resolve(config)
    broken: list[Any] = []
    with caplog.at_level(logging.INFO, logger="model_service.loading"):
        engine = group.leader_engine(config, cfg, broken.append)
    try:
        assert loaded.compiles == 1 and compiled(caplog) == 1 and broken == []
    finally:
        engine.close()


@pytest.mark.parametrize("on", [True, False], ids=["huge-pages-on", "huge-pages-off"])
def test_build_engine_backs_the_weights_with_huge_pages_after_compiling(monkeypatch: pytest.MonkeyPatch,
                                                                        on: bool) -> None:
    from model_service import host_memory

    calls: list[str] = []
    monkeypatch.setattr(Engine, "compile", lambda self: calls.append("compile") or {"fake": 0.0})
    monkeypatch.setattr(host_memory, "huge_pages", lambda params: calls.append("huge pages") or {})
    config = golden_server_config(slots=2, huge_pages=on)
    build_engine(config, resolve(config))
    assert calls == (["compile", "huge pages"] if on else ["compile"])


def test_the_huge_pages_flag_reaches_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from model_service.__main__ import parser

    assert parser().parse_args(["--config", "grok-1"]).huge_pages == "on"
    assert parser().parse_args(["--config", "grok-1", "--huge-pages", "off"]).huge_pages == "off"
    monkeypatch.setenv("GROK_MODEL_HUGE_PAGES", "off")
    assert parser().parse_args(["--config", "grok-1"]).huge_pages == "off"
