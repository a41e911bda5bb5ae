"""Fixtures of the deployment tests: a local stand-in for the image's /app, holding what the Dockerfile copies."""

from __future__ import annotations

import pathlib

import pytest

from tests.conftest import COMPILE_CACHE
from tests.deploy.compose import build_context_entries
from tests.procs import ROOT


@pytest.fixture(scope="session")
def image_app(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A local /app holding what the image holds: the allowlisted build context (linked), demo/ included."""
    app = tmp_path_factory.mktemp("app")
    for name in build_context_entries():
        if (ROOT / name).exists():
            (app / name).symlink_to(ROOT / name)
    return app


def compile_cache_volume() -> pathlib.Path:
    """The model containers' compile-cache volume (/var/cache/grok), one for the whole run: compose's replicas
    share it as the named volume makes them, and the Kubernetes pods, with the same settings, read what those
    compiled (the run's own cache is for programs compiled with the tests' XLA flags; the containers run with
    none). Inside the run's cache folder, so it goes when that does."""
    volume = pathlib.Path(COMPILE_CACHE) / "container-volume"
    volume.mkdir(exist_ok=True)
    return volume
