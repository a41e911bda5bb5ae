"""Test-wide setup, before JAX is imported anywhere: 8 host CPU devices for the sharding tests, and
no excess precision so bfloat16 results do not depend on XLA's fusion choices (golden/README.md).

One JAX compilation cache serves the whole run: `make test` runs the suite in two pytest-xdist workers, and the
controller makes the cache before it starts them, so the workers, the model services every test starts (through
GROK_MODEL_COMPILE_CACHE, unless a test passes its own --compile-cache) and the engines built inside the
test processes all read and write the same programs. A multi-process replica does not use it (the service says
why in its log)."""

import os
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


@pytest.fixture(scope="session")
def jax_cache() -> str:
    """The run's JAX compilation cache, for the model services and tools a test starts with --compile-cache."""
    return COMPILE_CACHE
