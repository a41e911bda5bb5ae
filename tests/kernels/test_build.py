"""The install built the native kernels where it can: on x86-64 Linux with a C++ compiler (CI's machine and
every supported deployment) a missing extension is a failed build, not a reason to skip the kernel tests."""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from model_service import kernels


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64" or not shutil.which("c++"),
                    reason="the kernels are built for x86-64 Linux with a C++ compiler")
def test_pip_install_built_the_native_kernels_on_x86_64_linux() -> None:
    if os.environ.get(kernels.ISA_ENV) == "off":
        pytest.skip(f"{kernels.ISA_ENV}=off disables them on purpose")
    assert kernels.available(), "model_service/kernels/_native was not built by `pip install -e .`: see its output"
    assert "scalar" in kernels.supported_isas()
