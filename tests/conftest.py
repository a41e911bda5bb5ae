"""Test-wide setup, before JAX is imported anywhere: 8 host CPU devices for the sharding tests, and
no excess precision so bfloat16 results do not depend on XLA's fusion choices (golden/README.md).

One JAX compilation cache serves the whole run: `make test` runs the suite in two pytest-xdist workers, and the
controller makes the cache before it starts them, so the workers, the model services every test starts (through
GROK_MODEL_COMPILE_CACHE, unless a test passes its own --compile-cache) and the engines built inside the
test processes all read and write the same programs. A multi-process replica does not use it (the service says
why in its log)."""

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


def pytest_configure(config: pytest.Config) -> None:
    from model_service.__main__ import configure_jax  # the cache settings a model service applies

    configure_jax(COMPILE_CACHE)


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


FILE_SECONDS = pathlib.Path(__file__).with_name("file_seconds.json")
SLOW_FILE_SECONDS = 30.0  # a file marked slow (it starts several processes) that file_seconds.json does not list yet
_seconds: dict[str, float] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-file-seconds", action="store_true",
                     help=f"write the seconds each test file took in this run into {FILE_SECONDS.name} "
                          "(the order of later runs)")


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first, by the seconds each took in a recorded run (file_seconds.json): the workers take
    whole files in this order (`make test` passes --no-loadscope-reorder), so the last files to start are the
    short ones and neither worker ends on a long file while the other idles. The sort is stable, so each file's
    tests stay together and in their order."""
    recorded = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    slow = {_file(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def seconds(item: pytest.Item) -> float:
        name = _file(item.nodeid)
        return recorded.get(name, SLOW_FILE_SECONDS if name in slow else 0.0)

    items.sort(key=lambda item: -seconds(item))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # On the controller this sees every worker's reports too.
    _seconds[_file(report.nodeid)] = _seconds.get(_file(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if config.getoption("--store-file-seconds") and not hasattr(config, "workerinput"):
        recorded = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
        recorded.update({name: round(s, 1) for name, s in _seconds.items()})
        FILE_SECONDS.write_text(json.dumps(dict(sorted(recorded.items())), indent=0) + "\n")


@pytest.fixture(scope="session")
def jax_cache() -> str:
    """The run's JAX compilation cache, for the model services and tools a test starts with --compile-cache."""
    return COMPILE_CACHE
