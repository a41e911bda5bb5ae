"""Test-wide setup, before JAX is imported anywhere: 8 host CPU devices for the sharding tests, and
no excess precision so bfloat16 results do not depend on XLA's fusion choices (golden/README.md).

One JAX compilation cache serves the whole run: `make test` runs the suite in pytest-xdist workers, and the
controller makes the cache before it starts them, so the workers, the model services every test starts (through
GROK_MODEL_COMPILE_CACHE, unless a test passes its own --compile-cache) and the engines built inside the
test processes all read and write the same programs. A multi-process replica does not use it (the service says
why in its log)."""

import collections
import json
import os
import pathlib
import shutil
import tempfile

import pytest

from tests.progress import TimedProgress, fast_files, file_of
from tests.reference import missing_reference

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "--xla_allow_excess_precision" not in _flags:
    _flags += " --xla_allow_excess_precision=false"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_CACHE_OWNER = "GROK_TEST_COMPILE_CACHE_OWNER"  # the pid of the process that made the run's cache
if "GROK_MODEL_COMPILE_CACHE" not in os.environ:
    os.environ["GROK_MODEL_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="grok-test-jax-cache-")
    os.environ[_CACHE_OWNER] = str(os.getpid())
COMPILE_CACHE = os.environ["GROK_MODEL_COMPILE_CACHE"]


# Each test file's seconds in a recent run (setup, call and teardown of its tests), written by
# `make test PYTEST_ARGS=--record-file-seconds=tests/file_seconds.json`. Only the order of the run depends on it.
FILE_SECONDS = pathlib.Path(__file__).with_name("file_seconds.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-file-seconds", metavar="PATH",
                     help="write each test file's seconds in this run as JSON to PATH (tests/file_seconds.json "
                          "orders the next runs)")
    parser.addoption("--max-file-seconds", type=float, default=None, metavar="S",
                     help="run only the test files that took at most S seconds in the recorded run "
                          "(tests/file_seconds.json; `make test-fast`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files longest first, each file's tests in their own order. `make test`'s workers take a whole file
    at a time, so a long file handed out last would keep one worker busy while the other idles; xdist's own
    reorder (most tests first) put the few long end-to-end files last. A file not in the table counts as one
    second."""
    seconds = recorded_seconds()
    if not seconds:
        return
    limit = config.getoption("--max-file-seconds")
    if limit is not None:
        keep = fast_files({file_of(item.nodeid) for item in items}, seconds, limit)
        config.hook.pytest_deselected(items=[item for item in items if file_of(item.nodeid) not in keep])
        items[:] = [item for item in items if file_of(item.nodeid) in keep]
    if not hasattr(config, "workerinput"):  # one process runs them all (no xdist)
        _progress(config).plan(item.nodeid for item in items)
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], index)
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 1.0),
                                 first_seen[item.nodeid.split("::")[0]]))


def recorded_seconds() -> dict[str, float]:
    try:
        return json.loads(FILE_SECONDS.read_text())
    except (OSError, ValueError):
        return {}


_file_seconds: collections.Counter[str] = collections.Counter()


def _progress(config: pytest.Config) -> TimedProgress:
    """The controller's progress by recorded time (tests/progress.py), written on the terminal."""
    if not hasattr(config, "_timed_progress"):
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        write = (lambda line: reporter.write_line(f"test time: {line}")) if reporter else (lambda line: None)
        config._timed_progress = TimedProgress(recorded_seconds(), write)  # type: ignore[attr-defined]
    return config._timed_progress  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """The controller learns the run's tests from the first worker that collected them."""
    config = node.config  # type: ignore[attr-defined]
    workers = min(int(getattr(config.option, "numprocesses", 1) or 1), os.cpu_count() or 1)
    _progress(config).plan(ids, workers)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _file_seconds[report.nodeid.split("::")[0]] += report.duration
    if report.when == "teardown" and _config is not None and not hasattr(_config, "workerinput"):
        _progress(_config).finished(report.nodeid)


_config: pytest.Config | None = None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that reads the reference fixtures (../shared) fails at once, naming them, when they are missing."""
    if (problem := missing_reference(item)) is not None:
        pytest.fail(problem, pytrace=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--record-file-seconds")
    if path and not hasattr(session.config, "workerinput"):  # the controller, which sees every worker's reports
        table = {name: round(seconds, 1) for name, seconds in sorted(_file_seconds.items())}
        pathlib.Path(path).write_text(json.dumps(table, indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config
    from model_service.__main__ import configure_jax  # the cache settings a model service applies

    configure_jax(COMPILE_CACHE)


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def jax_cache() -> str:
    """The run's JAX compilation cache, for the model services and tools a test starts with --compile-cache."""
    return COMPILE_CACHE
