"""serving_common.logs: one JSON line per record, and no library chatter a user cannot act on."""

from __future__ import annotations

import json
import logging
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
