"""Builds the optional CPU kernels (model_service/kernels/native) as a setuptools extension.

Project metadata lives in pyproject.toml; this file only declares the extension. The XLA FFI headers come
from jaxlib (a build requirement). The extension is optional: if it cannot be compiled the package still
installs and the model uses XLA's products (model_service.kernels logs why once).
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = "model_service/kernels/native"


def _ffi_include() -> list[str]:
    try:
        import jax.ffi

        return [jax.ffi.include_dir()]
    except Exception as e:  # noqa: BLE001 - any failure only disables the optional extension
        print(f"grok-serve: XLA FFI headers not found ({e}); skipping the native kernels", file=sys.stderr)
        return []


def _compile_in_parallel(compiler: object) -> None:
    """Compile an extension's sources on every core (setuptools compiles them one after another), each in its
    own compiler process; the object directories are made first."""
    serial = compiler.compile  # type: ignore[attr-defined]

    def compile(sources: list[str], output_dir: str | None = None, *args: object, **kwargs: object) -> list[str]:
        jobs = min(len(sources), os.cpu_count() or 1)
        if jobs < 2:
            return serial(sources, output_dir, *args, **kwargs)
        for obj in compiler.object_filenames(sources, output_dir=output_dir):  # type: ignore[attr-defined]
            os.makedirs(os.path.dirname(obj) or ".", exist_ok=True)
        with ThreadPoolExecutor(jobs) as pool:
            objects = list(pool.map(lambda source: serial([source], output_dir, *args, **kwargs), sources))
        return [obj for objs in objects for obj in objs]

    compiler.compile = compile  # type: ignore[attr-defined]


class OptionalBuildExt(build_ext):
    """Build the kernels when possible; a failed build leaves the pure-XLA path (never a failed install)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001
            print(f"grok-serve: native kernels not built ({e}); the model will use XLA's products", file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        if not ext.include_dirs:
            print("grok-serve: native kernels not built (no FFI headers)", file=sys.stderr)
            return
        try:
            _compile_in_parallel(self.compiler)
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"grok-serve: native kernels not built ({e}); the model will use XLA's products", file=sys.stderr)


# Each instruction set's file selects its own target with `#pragma GCC target`; the flags here are baseline
# x86-64 (never -march=native). -ffp-contract=off keeps every path's per-element operation order identical.
native = Extension(
    "model_service.kernels._native",
    sources=[f"{NATIVE}/ffi.cc", f"{NATIVE}/matmul_scalar.cc", f"{NATIVE}/matmul_avx2.cc", f"{NATIVE}/matmul_avx512.cc",
             f"{NATIVE}/qmatmul_scalar.cc", f"{NATIVE}/qmatmul_avx2.cc", f"{NATIVE}/qmatmul_avx512.cc",
             f"{NATIVE}/nucleus.cc", f"{NATIVE}/attention.cc", f"{NATIVE}/attention_scalar.cc",
             f"{NATIVE}/attention_avx2.cc", f"{NATIVE}/attention_avx512.cc"],
    depends=[f"{NATIVE}/matmul.h", f"{NATIVE}/matmul_body.h", f"{NATIVE}/attention.h", f"{NATIVE}/attention_body.h"],
    include_dirs=_ffi_include(),
    language="c++",
    extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden"],
    optional=True,
)

setup(ext_modules=[native], cmdclass={"build_ext": OptionalBuildExt})
