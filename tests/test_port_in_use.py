"""A second service started on a port another one already listens on refuses to start: exit code
not 0, a message naming the port. gRPC turns SO_REUSEPORT on by default, which let two listeners
share one port and split the calls between them."""

from __future__ import annotations

import asyncio
import pathlib
import socket
import subprocess
import sys

import pytest

from serving_common.grpc_server import bind, new_server
from tests.procs import GROK1_TOKENIZER, ROOT, Service, free_port


def run_until_exit(args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_second_grpc_server_on_a_bound_port_fails_naming_the_port() -> None:
    async def scenario() -> None:
        first = new_server("first")
        port = bind(first, "127.0.0.1", 0)
        await first.start()
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                bind(new_server("second"), "127.0.0.1", port)
        finally:
            await first.stop(None)
    asyncio.run(scenario())


def test_a_second_tokenizer_and_a_gateway_on_the_tokenizers_port_exit_non_zero(tmp_path: pathlib.Path) -> None:
    port = free_port()
    first = Service("tokenizer_service", ["--model", str(GROK1_TOKENIZER), "--port", str(port)], port, log_dir=tmp_path)
    try:
        first.wait_serving(60)
        second = run_until_exit(["tokenizer_service", "--model", str(GROK1_TOKENIZER), "--port", str(port)])
        assert second.returncode != 0
        assert f"127.0.0.1:{port}" in second.stderr
        gateway = run_until_exit(["gateway", "--tokenizer", first.address, "--model", f"127.0.0.1:{free_port()}",
                                  "--port", str(port), "--http-port", "0"])
        assert gateway.returncode != 0
        assert f"127.0.0.1:{port}" in gateway.stderr
    finally:
        first.terminate()


def test_the_gateways_http_port_and_a_metrics_port_in_use_stop_the_gateway(tmp_path: pathlib.Path) -> None:
    for flag in ("--http-port", "--metrics-port"):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            result = run_until_exit(["gateway", "--tokenizer", f"127.0.0.1:{free_port()}",
                                     "--model", f"127.0.0.1:{free_port()}", "--port", "0",
                                     *(["--http-port", "0"] if flag != "--http-port" else []), flag, str(port)])
        assert result.returncode != 0, flag
        assert str(port) in result.stderr, (flag, result.stderr[-2000:])
