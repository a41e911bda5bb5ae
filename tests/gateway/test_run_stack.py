"""scripts/run_stack.py (what `make run` runs): starts the three services, streams a sample, stops on Ctrl-C,
on SIGHUP (the terminal closed) and, through the children themselves, when the launcher is killed."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading

import pytest

from serving_common.healthcheck import check
from tests.procs import GOLDEN, ROOT, free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def test_run_stack_serves_streams_a_sample_and_stops_all_three_on_ctrl_c(jax_cache: str) -> None:
    ports = [free_port() for _ in range(3)]
    proc = subprocess.Popen(
        [sys.executable, "scripts/run_stack.py", "--config", str(GOLDEN / "config.json"),
         "--checkpoint", str(GOLDEN / "checkpoint"), "--tokenizer", str(GOLDEN / "tokenizer.model"),
         "--gateway-port", str(ports[0]), "--tokenizer-port", str(ports[1]), "--model-port", str(ports[2]),
         "--metrics-port", "0", "--model-metrics-port", "0", "--http-port", "0",
         "--compile-cache", jax_cache, "--max-tokens", "6", "--prompt", "In the beginning"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        def ready() -> bool:
            assert proc.poll() is None, "".join(lines)[-4000:]
            return any("Ctrl-C stops all three" in line for line in list(lines))
        wait_until(ready, 600, interval=0.2, message=lambda: "".join(lines)[-4000:])
        output = "".join(lines)
        assert "[finish: length; tokens: 8 prompt + 6 completion" in output
        assert "grpcurl -plaintext -d" in output and f"127.0.0.1:{ports[0]}" in output
        assert "-m gateway.client" in output
        assert all(check(f"127.0.0.1:{p}") for p in ports)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:  # the test failed: do not leave the services behind
            for pid in re.findall(r"\(pid (\d+)\)", "".join(lines)):
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.kill()
            proc.wait()
    reader.join(5)
    output = "".join(lines)
    for name in ("gateway", "model", "tokenizer"):
        assert f"run_stack: {name} exited with 0" in output
    assert not any(check(f"127.0.0.1:{p}", timeout=0.5) for p in ports)


class Launcher:
    """run_stack.py in its own process group (as a terminal runs it), its output collected."""

    def __init__(self, jax_cache: str) -> None:
        self.ports = [free_port() for _ in range(3)]
        self.proc = subprocess.Popen(
            [sys.executable, "scripts/run_stack.py", "--config", str(GOLDEN / "config.json"),
             "--checkpoint", str(GOLDEN / "checkpoint"), "--tokenizer", str(GOLDEN / "tokenizer.model"),
             "--gateway-port", str(self.ports[0]), "--tokenizer-port", str(self.ports[1]),
             "--model-port", str(self.ports[2]), "--metrics-port", "0", "--model-metrics-port", "0", "--http-port", "0",
             "--compile-cache", jax_cache, "--max-tokens", "2", "--prompt", "In the beginning"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)  # type: ignore[arg-type]
        self.reader.start()

    def output(self) -> str:
        return "".join(list(self.lines))

    def wait_serving(self) -> list[int]:
        def ready() -> bool:
            assert self.proc.poll() is None, self.output()[-4000:]
            return "Ctrl-C stops all three" in self.output()
        wait_until(ready, 600, interval=0.2, message=lambda: self.output()[-4000:])
        return [int(pid) for pid in re.findall(r"\(pid (\d+)\)", self.output())]

    def cleanup(self, pids: list[int]) -> None:
        for pid in [*pids, self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return pathlib.Path(f"/proc/{pid}").exists() and "zombie" not in pathlib.Path(f"/proc/{pid}/status").read_text()


def test_closing_the_terminal_sighup_stops_all_three_services(jax_cache: str) -> None:
    launcher = Launcher(jax_cache)
    pids: list[int] = []
    try:
        pids = launcher.wait_serving()
        assert len(pids) == 3
        os.killpg(launcher.proc.pid, signal.SIGHUP)  # what the terminal sends its process group
        launcher.proc.wait(60)
        wait_until(lambda: not any(alive(pid) for pid in pids), 30, interval=0.2,
                   message=lambda: f"services outlived the launcher:\n{launcher.output()[-3000:]}")
        assert not any(check(f"127.0.0.1:{p}", timeout=0.5) for p in launcher.ports)
    finally:
        launcher.cleanup(pids)


def test_services_exit_when_their_launcher_is_killed(jax_cache: str) -> None:
    launcher = Launcher(jax_cache)
    pids: list[int] = []
    try:
        pids = launcher.wait_serving()
        launcher.proc.kill()  # SIGKILL: the launcher cannot stop anything itself
        launcher.proc.wait(10)
        wait_until(lambda: not any(alive(pid) for pid in pids), 30, interval=0.2,
                   message="services outlived their killed launcher")
        assert not any(check(f"127.0.0.1:{p}", timeout=0.5) for p in launcher.ports)
    finally:
        launcher.cleanup(pids)
