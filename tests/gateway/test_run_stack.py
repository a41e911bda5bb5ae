"""scripts/run_stack.py (what `make run` runs): starts the three services, streams a sample, stops on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from serving_common.healthcheck import check
from tests.procs import GOLDEN, ROOT, free_port

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
        deadline = time.monotonic() + 600
        while not any("Ctrl-C stops all three" in line for line in list(lines)):
            assert proc.poll() is None, "".join(lines)[-4000:]
            assert time.monotonic() < deadline, "".join(lines)[-4000:]
            time.sleep(0.2)
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
