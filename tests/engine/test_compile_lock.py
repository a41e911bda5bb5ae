"""Processes sharing a compilation cache compile a given set of programs one at a time; other programs and
processes without a cache never wait (model_service/compile_lock.py)."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import pytest

from model_service.compile_lock import compiling_alone, lock_path
from model_service.loading import programs_key, resolve
from tests.engine.conftest import golden_server_config


def hold(cache: pathlib.Path, key: str, entered: threading.Event, release: threading.Event) -> threading.Thread:
    """A thread that holds `key`'s lock (its own open file, as another process would) until `release`."""
    def body() -> None:
        with compiling_alone(str(cache), key):
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    assert entered.wait(10)
    return thread


def test_the_same_programs_wait_for_the_holder_and_others_do_not(tmp_path: pathlib.Path) -> None:
    entered, release = threading.Event(), threading.Event()
    holder = hold(tmp_path, "programs A", entered, release)
    with compiling_alone(str(tmp_path), "programs B", wait_seconds=0.0):  # another key: taken at once
        pass
    order: list[str] = []
    waiter_in = threading.Event()

    def waiter() -> None:
        with compiling_alone(str(tmp_path), "programs A", poll_seconds=0.01):
            order.append("waiter")
            waiter_in.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    assert not waiter_in.wait(0.3)  # still held: the waiter waits
    order.append("holder done")
    release.set()
    holder.join(10)
    assert waiter_in.wait(10) and order == ["holder done", "waiter"]
    thread.join(10)
    assert pathlib.Path(lock_path(str(tmp_path), "programs A")).exists()


def test_the_wait_is_bounded_then_the_waiter_compiles_on_its_own(tmp_path: pathlib.Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    entered, release = threading.Event(), threading.Event()
    holder = hold(tmp_path, "programs A", entered, release)
    try:
        with caplog.at_level(logging.INFO, logger="model_service.compile_lock"):
            with compiling_alone(str(tmp_path), "programs A", wait_seconds=0.05, poll_seconds=0.01):
                ran = True
        assert ran
        messages = [r.getMessage() for r in caplog.records]
        assert "another process is compiling the same programs into the cache; waiting for it" in messages
        assert "the other process is still compiling; compiling here too" in messages
    finally:
        release.set()
        holder.join(10)


def test_no_cache_or_an_unusable_one_compiles_without_a_lock(tmp_path: pathlib.Path) -> None:
    with compiling_alone(None, "programs A"):
        pass
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with compiling_alone(str(blocker), "programs A", wait_seconds=0.0):  # the lock folder cannot be made
        pass


def test_program_keys_differ_by_what_the_programs_depend_on_only() -> None:
    base = golden_server_config()
    cfg = resolve(base)
    key = programs_key(base, cfg)
    assert programs_key(golden_server_config(port=1234, max_queue=3, metrics_port=9), cfg) == key
    for change in ({"slots": 4}, {"dtype": "bfloat16"}, {"block_size": 8}, {"tile_rows": 2}, {"backend": "generic"}):
        assert programs_key(golden_server_config(**change), cfg) != key, change
    assert programs_key(golden_server_config(config="/elsewhere/config.json"), cfg) == key  # the config, not its path
    assert programs_key(base, dataclasses.replace(cfg, eos_token=cfg.eos_token + 1)) != key
