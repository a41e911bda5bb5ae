"""serving_common.logs: one JSON line per record, and no library chatter a user cannot act on."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Iterator

import pytest

from serving_common import logs


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, {name: logging.getLogger(name).level for name in logs.QUIET_LIBRARIES})
    yield
    root.handlers[:], _, levels = saved
    root.setLevel(saved[1])
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def records(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines()]


def test_jax_backend_probe_info_is_not_logged_at_info_level(restore_logging: None,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("model", "info")
    # What jax logs on every machine without a TPU while it picks a backend.
    logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu': no libtpu.so")
    logging.getLogger("model_service.server").info("serving")
    assert [r["msg"] for r in records(capsys)] == ["serving"]


def test_jax_warnings_are_still_logged(restore_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("model", "info")
    logging.getLogger("jax._src.xla_bridge").warning("a CUDA-enabled jaxlib is not installed; falling back to cpu")
    assert [r["level"] for r in records(capsys)] == ["warning"]


def test_debug_level_shows_jax_info_too(restore_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("model", "debug")
    logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu': no libtpu.so")
    assert [r["logger"] for r in records(capsys)] == ["jax._src.xla_bridge"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_writes_text_on_a_terminal_and_json_elsewhere(restore_logging: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logs.configure("gateway", "info", "auto")
    logging.getLogger("gateway.servicer").info("request", extra={"method": "Complete", "code": "OK"})
    line = terminal.getvalue().strip()
    assert not line.startswith("{")
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3} INFO +gateway  request  method=Complete code=OK", line), line
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    logs.configure("gateway", "info", "auto")
    logging.getLogger("gateway.servicer").info("request", extra={"method": "Complete"})
    assert json.loads(pipe.getvalue())["method"] == "Complete"


def test_log_format_forces_either_on_any_stream(restore_logging: None, monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logs.configure("model", "info", "json")
    logging.getLogger("model_service").info("serving")
    assert json.loads(terminal.getvalue())["msg"] == "serving"
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    logs.configure("model", "info", "text")
    token = logs.request_id_var.set("rid-7")
    try:
        logging.getLogger("model_service").warning("slow step")
    finally:
        logs.request_id_var.reset(token)
    assert pipe.getvalue().rstrip().endswith("WARNING model  slow step  [request rid-7]")


def test_every_service_takes_log_format() -> None:
    from gateway.__main__ import parse_config
    from model_service.__main__ import parser
    from tokenizer_service.__main__ import parse_args

    assert parse_args(["--model", "m.model", "--log-format", "text"]).log_format == "text"
    assert parse_config(["--tokenizer", "t:1", "--model", "m:2", "--log-format", "json"]).log_format == "json"
    assert parser().parse_args(["--config", "c", "--log-format", "text"]).log_format == "text"
    assert parser().parse_args(["--config", "c"]).log_format == "auto"
