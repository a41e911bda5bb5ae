"""Test-wide setup: 8 host CPU devices for the sharding tests (must happen before JAX is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
