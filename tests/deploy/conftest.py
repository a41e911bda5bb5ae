"""Fixtures of the deployment tests: a local stand-in for the image's /app, built as the Dockerfile builds it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.deploy.compose import (
    build_context_entries, dockerfile_instructions, image_environment, shell_commands, stage)
from tests.procs import ROOT


def demo_stage_build(app: pathlib.Path) -> None:
    """Run the RUN commands of the Dockerfile's `demo` stage in `app` (a stand-in for /app)."""
    instructions = dockerfile_instructions()
    env = {**os.environ, "PYTHONPATH": str(app), "XLA_FLAGS": "", **image_environment(instructions, "demo")}
    runs = [rest for keyword, rest in stage(instructions, "demo") if keyword == "RUN"]
    assert runs, "the Dockerfile's demo stage runs nothing"
    for run in runs:
        for command in shell_commands(run):
            argv = [sys.executable if command[0] == "python" else command[0], *command[1:]]
            done = subprocess.run(argv, cwd=app, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"Dockerfile demo stage: {' '.join(command)} failed:\n{done.stderr[-4000:]}"


@pytest.fixture(scope="session")
def image_app(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A local /app holding what the image holds: the allowlisted source (linked) and artifacts/demo."""
    app = tmp_path_factory.mktemp("app")
    for name in build_context_entries():
        if (ROOT / name).exists():
            (app / name).symlink_to(ROOT / name)
    demo_stage_build(app)
    return app
