"""The image carries the native CPU kernels: a builder stage compiles them with pip, only the extension reaches
the runtime stage (which has no compiler), and the image fails its build when the kernels do not load.

Without a Docker engine the stages are read here, and the runtime stage's check runs on a stand-in /app with and
without the extension this checkout built; `make compose-check` builds the image itself, kernels stage included.
"""

from __future__ import annotations

import ast
import glob
import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest

from tests.deploy.compose import build_context_entries, dockerfile_instructions, shell_commands, stage
from tests.procs import ROOT


def kernels_built() -> bool:
    return bool(glob.glob(str(ROOT / "model_service" / "kernels" / "_native*.so")))


def _can_build_natively() -> bool:
    """x86-64 Linux with a C++ compiler and a setuptools new enough for the stage's --no-build-isolation build."""
    try:
        setuptools_major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return False
    return (platform.system() == "Linux" and platform.machine() == "x86_64" and bool(shutil.which("c++"))
            and setuptools_major >= 77)


def _runs(name: str) -> list[str]:
    return [rest for kw, rest in stage(dockerfile_instructions(), name) if kw == "RUN"]


def _pip_build_command() -> list[str]:
    (cmd,) = [c for run in _runs("kernels") for c in shell_commands(run) if c[:2] == ["pip", "install"] and "--target" in c]
    return cmd


def _runtime_check_script() -> str:
    (cmd,) = [c for run in _runs("runtime") for c in shell_commands(run) if c[:2] == ["python", "-c"]]
    return cmd[2]


def _kernel_copy() -> tuple[str, str]:
    """(source in the kernels stage, destination under /app) of the runtime's COPY --from=kernels."""
    (copy,) = [rest for kw, rest in stage(dockerfile_instructions(), "runtime") if kw == "COPY" and "--from=kernels" in rest]
    _, source, dest = copy.split()
    return source, dest


def test_kernels_compile_in_a_builder_stage_and_only_the_extension_reaches_the_runtime() -> None:
    instructions = dockerfile_instructions()
    assert ("FROM", "deps AS kernels") in instructions  # built against the venv's own jax/jaxlib
    kernels = " ".join(_runs("kernels"))
    assert "apt-get install -y --no-install-recommends g++" in kernels
    build = _pip_build_command()
    assert {"--no-deps", "--no-build-isolation"} <= set(build) and build[-1] == "."
    source, dest = _kernel_copy()
    assert source.startswith(build[build.index("--target") + 1] + "/") and source.endswith("/_native*.so")
    assert dest == "model_service/kernels/"
    runtime = stage(instructions, "runtime")
    assert ("COPY", "--from=deps /opt/venv /opt/venv") in runtime
    runtime_runs = " ".join(rest for kw, rest in runtime if kw == "RUN")
    assert not any(tool in runtime_runs for tool in ("apt-get", "g++", "pip"))
    # Baseline flags only: each instruction set is chosen at run time, so the image runs on any x86-64 host.
    assert not any("-march" in rest or "FLAGS" in rest for _, rest in instructions)
    literals = [n.value for n in ast.walk(ast.parse((ROOT / "setup.py").read_text())) if isinstance(n, ast.Constant)]
    assert "-O3" in literals and not [v for v in literals if isinstance(v, str) and v.startswith(("-march", "-mtune"))]


def test_image_refuses_to_build_unless_the_kernels_load() -> None:
    runtime = stage(dockerfile_instructions(), "runtime")
    (check,) = [i for i, (kw, rest) in enumerate(runtime) if kw == "RUN" and "kernels.available()" in rest]
    (copy,) = [i for i, (kw, rest) in enumerate(runtime) if kw == "COPY" and "--from=kernels" in rest]
    users = [i for i, (kw, _) in enumerate(runtime) if kw == "USER"]
    assert copy < check and users and users[-1] < check  # checks the copied file, as the user that serves
    assert "assert kernels.available()" in _runtime_check_script()


def test_build_context_holds_what_the_kernels_stage_copies_and_no_prebuilt_extension() -> None:
    allowed = build_context_entries()
    for kw, rest in stage(dockerfile_instructions(), "kernels"):
        if kw == "COPY":
            assert rest.split()[0].split("/")[0] in allowed, rest
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert "**/*.so" in ignored  # a kernel built in a checkout may suit another Python: the image builds its own


def _stand_in_app(root: pathlib.Path) -> pathlib.Path:
    """A local /app: the build context linked, model_service copied without any extension built in the checkout."""
    app = root / "app"
    app.mkdir()
    for name in build_context_entries():
        if name != "model_service" and (ROOT / name).exists():
            (app / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "model_service", app / "model_service", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return app


def _run_check(app: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GROK_KERNEL_ISA"}
    env.update(PYTHONPATH=str(app), PYTHONDONTWRITEBYTECODE="1", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", _runtime_check_script()], cwd=app, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not _can_build_natively(), reason="the kernels build on x86-64 Linux with a C++ compiler and setuptools>=77")
def test_kernels_stage_command_builds_the_checkouts_extension() -> None:
    """The stage's pip command builds what `make setup` builds here (the same setup.py, pip and sources); `make
    compose-check` runs the command itself, in the image, whose runtime stage fails to build without its result.
    Here: the command's flags leave setup.py's build as it is, and that build is in this checkout."""
    cmd = _pip_build_command()
    assert not [c for c in cmd if c.startswith(("--config-settings", "-C", "--global-option", "--build-option"))]
    assert kernels_built(), "make setup builds the extension"


@pytest.mark.skipif(not kernels_built(), reason="the extension is not built in this checkout (make setup builds it)")
def test_runtime_check_passes_only_with_the_extension_in_place(tmp_path: pathlib.Path) -> None:
    source, dest = _kernel_copy()
    (built,) = glob.glob(str(ROOT / "model_service" / "kernels" / pathlib.PurePath(source).name))
    app = _stand_in_app(tmp_path)
    refused = _run_check(app)  # what the build does when the kernels did not compile
    assert refused.returncode != 0 and "native kernels did not build or load" in refused.stderr, refused.stderr
    shutil.copy2(built, app / dest)
    passed = _run_check(app)
    assert passed.returncode == 0 and "scalar" in passed.stdout, passed.stderr
