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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files longest first, each file's tests in their own order. `make test`'s workers take a whole file
    at a time, so a long file handed out last would keep one worker busy while the other idles; xdist's own
    reorder (most tests first) put the few long end-to-end files last. A file not in the table counts as one
    second."""
    try:
        seconds = json.loads(FILE_SECONDS.read_text())
    except (OSError, ValueError):
        return
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], index)
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 1.0),
                                 first_seen[item.nodeid.split("::")[0]]))


_file_seconds: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _file_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--record-file-seconds")
    if path and not hasattr(session.config, "workerinput"):  # the controller, which sees every worker's reports
        table = {name: round(seconds, 1) for name, seconds in sorted(_file_seconds.items())}
        pathlib.Path(path).write_text(json.dumps(table, indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    from model_service.__main__ import configure_jax  # the cache settings a model service applies

    configure_jax(COMPILE_CACHE)


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def jax_cache() -> str:
    """The run's JAX compilation cache, for the model services and tools a test starts with --compile-cache."""
    return COMPILE_CACHE
