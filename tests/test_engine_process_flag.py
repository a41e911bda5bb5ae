"""--engine-process auto|on|off (model_service/__main__.py): auto puts the engine in a process of its own where an
accelerator is expected and the replica is one process, never on CPU; the environment's 1/0 still work."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from model_service.__main__ import engine_process_choice, engine_process_on, parser
from model_service.distributed.config import DistributedConfig
from tests.procs import GOLDEN, ROOT

GROUP = DistributedConfig(coordinator="h:1", num_processes=2, process_id=0)


@pytest.mark.parametrize("raw, value", [("auto", "auto"), ("ON", "on"), ("off", "off"), ("1", "on"), ("true", "on"),
                                        ("0", "off"), ("no", "off")])
def test_values_and_the_environments_booleans(raw: str, value: str) -> None:
    assert engine_process_choice(raw) == value


def test_anything_else_is_refused_naming_the_choices() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="auto, on, off"):
        engine_process_choice("sometimes")


def test_the_flag_alone_means_on_and_the_default_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GROK_MODEL_ENGINE_PROCESS", raising=False)
    assert parser().parse_args(["--config", "grok-1"]).engine_process == "auto"
    assert parser().parse_args(["--config", "grok-1", "--engine-process"]).engine_process == "on"
    monkeypatch.setenv("GROK_MODEL_ENGINE_PROCESS", "1")
    assert parser().parse_args(["--config", "grok-1"]).engine_process == "on"


@pytest.mark.parametrize("platforms, group, expected", [("tpu", None, True), ("cuda", None, True), ("cpu", None, False),
                                                        ("tpu", GROUP, False)])
def test_auto_is_on_where_an_accelerator_is_expected_for_one_process(monkeypatch: pytest.MonkeyPatch, platforms: str,
                                                                      group: DistributedConfig | None,
                                                                      expected: bool) -> None:
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert engine_process_on("auto", group) is expected
    assert engine_process_on("on", None) and not engine_process_on("off", None)


def test_a_bad_value_exits_2_before_loading() -> None:
    done = subprocess.run([sys.executable, "-m", "model_service", "--config", str(GOLDEN / "config.json"),
                           "--random-init", "--engine-process", "maybe"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "auto, on, off" in done.stderr
