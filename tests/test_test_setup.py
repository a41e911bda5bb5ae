"""The suite's own machinery (tests/conftest.py): the reference fixtures named when missing, the fast subset,
and progress by recorded time."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import types

import pytest

from tests.procs import ROOT
from tests.progress import TimedProgress, fast_files
from tests.reference import FIXTURES, missing_reference


def item_of(**module_globals: object) -> pytest.Item:
    module = types.ModuleType("fake_test_module")
    vars(module).update(module_globals)
    return types.SimpleNamespace(module=module, _fixtureinfo=None)  # type: ignore[return-value]


def test_a_test_reading_missing_reference_fixtures_is_failed_with_a_message_naming_them(
        tmp_path: pathlib.Path) -> None:
    shared = tmp_path / "shared"
    (shared / "golden").mkdir(parents=True)
    problem = missing_reference(item_of(WIDE=shared / "golden_wide", TOKENIZER=shared / "grok1-tokenizer" / "t"),
                                shared)
    assert problem is not None
    assert str(shared) in problem and "missing: golden_wide, grok1-tokenizer" in problem and "README.md" in problem
    assert missing_reference(item_of(OTHER=tmp_path / "x", n=3), shared) is None  # needs none: runs
    # golden/ alone is there (the TPU host's copy): a test that reads only golden/ runs
    assert missing_reference(item_of(GOLDEN=shared / "golden"), shared) is None
    for name in FIXTURES:
        (shared / name).mkdir(exist_ok=True)
    assert missing_reference(item_of(GOLDEN=shared / "golden"), shared) is None  # all there: runs


def test_fast_subset_keeps_files_recorded_under_the_limit_and_new_ones() -> None:
    seconds = {"tests/a.py": 0.5, "tests/b.py": 40.0, "tests/c.py": 5.0}
    assert fast_files(["tests/a.py", "tests/b.py", "tests/c.py", "tests/new.py"], seconds, 5.0) == {
        "tests/a.py", "tests/c.py", "tests/new.py"}


def test_progress_counts_recorded_seconds_of_finished_files_not_tests() -> None:
    lines: list[str] = []
    progress = TimedProgress({"tests/long.py": 90.0, "tests/short.py": 10.0}, lines.append)
    ids = ["tests/long.py::a", "tests/short.py::a", "tests/short.py::b", "tests/short.py::c"]
    progress.plan(ids, workers=2)
    assert "2 test files, 100 s of test time" in lines[0] and "about 50 s of pytest 2 at a time" in lines[0]
    progress.finished("tests/short.py::a")
    progress.finished("tests/short.py::b")
    assert len(lines) == 1  # a file counts when its last test is done
    progress.finished("tests/short.py::c")
    assert lines[-1] == "progress by recorded time: 10 % (10 of 100 s)"  # 3 of 4 tests, a tenth of the time
    progress.finished("tests/long.py::a")
    assert lines[-1] == "progress by recorded time: 100 % (100 of 100 s)"


def test_files_recorded_at_zero_seconds_report_no_progress_and_never_divide_by_zero() -> None:
    """A run of only files the recorded run timed at 0 s (quick files rounded down) has no time to share out."""
    lines: list[str] = []
    progress = TimedProgress({"tests/quick.py": 0.0}, lines.append)
    progress.plan(["tests/quick.py::a"], workers=1)
    progress.finished("tests/quick.py::a")
    assert lines == []


def test_make_test_fast_runs_the_fast_subset_in_workers() -> None:
    done = subprocess.run(["make", "--no-print-directory", "-n", "test-fast"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    command = done.stdout.splitlines()[-1]
    assert "--max-file-seconds 5" in command and " -n " in command and '-m "not slow"' in command


def test_max_file_seconds_deselects_the_long_files() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--max-file-seconds", "5", "tests/gateway/test_fuzz.py", "tests/test_logs.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "tests/test_logs.py::" in done.stdout and "tests/gateway/test_fuzz.py::" not in done.stdout, done.stdout
