"""scripts/run_stack.py (what `make run` runs) as a test fixture: the stack a user starts, on free ports.

`Launched` starts the launcher in its own process group (as a terminal runs it), collects its output and
gives the addresses and per-service log lines the tests read; `stop` is Ctrl-C.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from tests.procs import ROOT, free_port
from tests.waiting import wait_until

READY = "Ctrl-C stops all three"


class ServiceLines:
    """One service of the launched stack: its address and the log lines the launcher forwarded for it."""

    def __init__(self, launched: Launched, name: str, port: int) -> None:
        self.launched, self.name, self.port = launched, name, port
        self.address = f"127.0.0.1:{port}"

    def logs(self) -> str:
        prefix = f"[{self.name}] "
        return "".join(line[len(prefix):] for line in self.launched.lines() if line.startswith(prefix))


class Launched:
    """`python scripts/run_stack.py ARGS` with every port free (given ports override), output collected."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, http: bool = True) -> None:
        self.ports = {"gateway": free_port(), "tokenizer": free_port(), "model": free_port(),
                      "http": free_port() if http else 0, "metrics": free_port(), "model-metrics": free_port()}
        ports = ["--gateway-port", str(self.ports["gateway"]), "--tokenizer-port", str(self.ports["tokenizer"]),
                 "--model-port", str(self.ports["model"]), "--http-port", str(self.ports["http"]),
                 "--metrics-port", str(self.ports["metrics"]), "--model-metrics-port", str(self.ports["model-metrics"])]
        self.proc = subprocess.Popen([sys.executable, "scripts/run_stack.py", *ports, *args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        self._lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self._lines.extend(self.proc.stdout), daemon=True)  # type: ignore[arg-type]
        self.reader.start()
        self.tokenizer = ServiceLines(self, "tokenizer", self.ports["tokenizer"])
        self.models = [ServiceLines(self, "model", self.ports["model"])]
        self.gateway = ServiceLines(self, "gateway", self.ports["gateway"])

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def http_port(self) -> int:
        return self.ports["http"]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def lines(self) -> list[str]:
        return list(self._lines)

    def output(self) -> str:
        return "".join(self.lines())

    def wait_ready(self, timeout: float = 600) -> Launched:
        """Until the launcher has streamed its sample and serves (AssertionError if it exits first)."""
        def ready() -> bool:
            assert self.proc.poll() is None, self.output()[-4000:]
            return READY in self.output()
        wait_until(ready, timeout, interval=0.2, message=lambda: self.output()[-4000:])
        return self

    def pids(self) -> list[int]:
        return [int(pid) for pid in re.findall(r"\(pid (\d+)\)", self.output())]

    def stop(self, timeout: float = 60) -> int:
        """Ctrl-C (SIGINT to the launcher), as a terminal sends it; SIGKILL to everything if it does not stop."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.reader.join(5)
        return code

    def kill(self) -> None:
        """SIGKILL the launcher and the services it started (only while they may still run)."""
        for pid in [*self.pids(), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
