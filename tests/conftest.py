"""Test-wide setup, before JAX is imported anywhere: 8 host CPU devices for the sharding tests, and
no excess precision so bfloat16 results do not depend on XLA's fusion choices (golden/README.md)."""

import os

import pytest

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "--xla_allow_excess_precision" not in _flags:
    _flags += " --xla_allow_excess_precision=false"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A JAX compilation cache shared by the model services the session starts."""
    return str(tmp_path_factory.mktemp("jax_cache"))
