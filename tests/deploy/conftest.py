"""Fixtures of the deployment tests: a local stand-in for the image's /app, holding what the Dockerfile copies."""

from __future__ import annotations

import pathlib

import pytest

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
