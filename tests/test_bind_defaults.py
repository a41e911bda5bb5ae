"""Services started without --host listen on 127.0.0.1 only (gRPC and metrics): the internal services
have no authentication, so every interface is something a deployment asks for (compose does)."""

from __future__ import annotations

import pathlib

import pytest

from gateway.__main__ import parse_config as gateway_config
from model_service.__main__ import parser as model_parser
from tests.procs import GROK1_TOKENIZER, Service, free_port
from tests.waiting import wait_until
from tokenizer_service.__main__ import parse_args as tokenizer_config

LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
LOOPBACK_V6 = "00000000000000000000000001000000"  # ::1
LOOPBACK_MAPPED = "0000000000000000FFFF00000100007F"  # ::ffff:127.0.0.1 (gRPC binds IPv4 on a v6 socket)


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} list them) with a socket listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


def test_every_service_defaults_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GROK_TOKENIZER_HOST", "GROK_MODEL_HOST", "GROK_GATEWAY_HOST"):
        monkeypatch.delenv(name, raising=False)
    assert tokenizer_config(["--model", "m"]).host == "127.0.0.1"
    assert model_parser().parse_args(["--config", "c"]).host == "127.0.0.1"
    assert gateway_config(["--tokenizer", "t:1", "--model", "m:1"]).host == "127.0.0.1"


@pytest.mark.skipif(not pathlib.Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_started_without_host_the_gateway_and_tokenizer_listen_on_loopback_only(tmp_path: pathlib.Path) -> None:
    tokenizer_port, gateway_port, metrics_port, http_port = free_port(), free_port(), free_port(), free_port()
    tokenizer = Service("tokenizer_service", ["--model", str(GROK1_TOKENIZER), "--port", str(tokenizer_port)],
                        tokenizer_port, log_dir=tmp_path)
    gateway = Service("gateway", ["--tokenizer", tokenizer.address, "--model", f"127.0.0.1:{free_port()}",
                                  "--port", str(gateway_port), "--metrics-port", str(metrics_port),
                                  "--http-port", str(http_port)],
                      gateway_port, log_dir=tmp_path)
    try:
        tokenizer.wait_serving(60)
        ports = (tokenizer_port, gateway_port, metrics_port, http_port)
        wait_until(lambda: all(listening_addresses(p) for p in ports), 30, interval=0.1,
                   message=lambda: f"not every port is listening:\n{gateway.logs()[-2000:]}")
        for port in ports:
            assert listening_addresses(port) and listening_addresses(port) <= {LOOPBACK_V4, LOOPBACK_V6, LOOPBACK_MAPPED}, port
    finally:
        gateway.terminate()
        tokenizer.terminate()
