"""Unix socket listeners (serving_common.uds): an existing file is refused naming the path, never taken over;
the socket is owner-only and removed when its server is gone; the flags read their environment variables."""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import stat
import tempfile
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving_common import uds
from serving_common.grpc_server import SERVING
from serving_common.healthcheck import check
from serving_common.lifecycle import assemble
from serving_common.tls import ChannelTLS, ServerTLS
from tests.certs import make_pki
from tests.procs import GOLDEN, Service


@pytest.fixture
def short_dir() -> Iterator[pathlib.Path]:
    """A directory with a short path (a socket path has at most 107 bytes; pytest's tmp_path can be long)."""
    with tempfile.TemporaryDirectory(prefix="uds", dir="/tmp") as name:
        yield pathlib.Path(name)


def test_addresses_name_their_socket_file() -> None:
    assert uds.target("/run/grok/model.sock") == "unix:/run/grok/model.sock"
    assert uds.path_of("unix:/run/grok/model.sock") == "/run/grok/model.sock"
    assert uds.path_of("unix:///run/grok/model.sock") == "/run/grok/model.sock"
    assert uds.path_of("unix:model.sock") == "model.sock"
    assert uds.path_of("127.0.0.1:50051") is None


def test_free_path_is_accepted(short_dir: pathlib.Path) -> None:
    uds.check_free(str(short_dir / "a.sock"), "--uds")


def test_regular_file_is_refused_and_kept(short_dir: pathlib.Path) -> None:
    path = short_dir / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(OSError, match=r"--uds: .*notes.txt.* exists and is not a socket"):
        uds.check_free(str(path), "--uds")
    assert path.read_text() == "keep me"


def test_stale_socket_is_refused_with_the_fix(short_dir: pathlib.Path) -> None:
    path = short_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # bound, never listening, closed: what a killed server leaves
    with pytest.raises(OSError, match=r"stale.sock.* is a stale socket file .*remove it"):
        uds.check_free(str(path), "--uds")
    assert path.exists()


def test_socket_in_use_is_refused(short_dir: pathlib.Path) -> None:
    path = short_dir / "live.sock"
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen()
        with pytest.raises(OSError, match=r"live.sock.* is in use"):
            uds.check_free(str(path), "--uds")


def test_missing_directory_and_long_path_are_refused(short_dir: pathlib.Path) -> None:
    with pytest.raises(OSError, match="does not exist"):
        uds.check_free(str(short_dir / "nowhere" / "a.sock"), "--uds")
    with pytest.raises(OSError, match="at most 107"):
        uds.check_free(str(short_dir / ("x" * 120)), "--uds")


def test_bound_unix_socket_is_owner_only_and_removed(short_dir: pathlib.Path) -> None:
    path = short_dir / "http.sock"
    sock, made = uds.bind_unix(str(path), "--http-uds")
    try:
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    finally:
        sock.close()
    made.remove()
    assert not path.exists()


def test_remove_leaves_a_file_that_is_no_longer_ours(short_dir: pathlib.Path) -> None:
    path = short_dir / "x.sock"
    sock, made = uds.bind_unix(str(path), "--uds")
    sock.close()
    path.unlink()
    path.write_text("someone else's")
    made.remove()
    assert path.read_text() == "someone else's"


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


def test_grpc_server_on_a_unix_socket(short_dir: pathlib.Path) -> None:
    """assemble(uds=...): health answers on unix:PATH, the file is 0600, a second server is refused, and the
    file is gone once the server stopped."""
    path = short_dir / "svc.sock"

    async def run() -> None:
        built = assemble("test", "grpc.health.v1.Health", lambda server: None, "127.0.0.1", 0, None, uds=str(path))
        assert built.port == 0
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        await built.server.start()
        await built.health.set(True)
        assert await _health(uds.target(str(path))) == SERVING
        with pytest.raises(OSError, match="is in use"):
            assemble("test", "grpc.health.v1.Health", lambda server: None, "127.0.0.1", 0, None, uds=str(path))
        assert await _health(uds.target(str(path))) == SERVING  # the first server still has it
        await built.server.stop(0)

    asyncio.run(run())
    assert not path.exists()


def test_tokenizer_service_refuses_a_stale_socket_by_name(short_dir: pathlib.Path) -> None:
    """The service exits 2 with a one-line message naming the flag and the path; the file stays."""
    path = short_dir / "tok.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))
    service = Service("tokenizer_service", ["--model", str(GOLDEN / "tokenizer.model")], 0, log_dir=short_dir,
                      env={"GROK_TOKENIZER_UDS": str(path)})  # the environment variable beside the flag
    assert service.proc.wait(60) == 2
    service.terminate()
    logs = service.logs()
    assert "--uds" in logs and str(path) in logs and "stale socket file" in logs, logs
    assert "Traceback" not in logs
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_mutual_tls_on_a_unix_socket(short_dir: pathlib.Path) -> None:
    """TLS works on a socket file as on a port. A unix: target has no host name (gRPC checks the certificate against
    the path), so a client names the certificate's host (--tls-server-name); without it the handshake fails, and
    mutual TLS still refuses a client without a certificate."""
    pki = make_pki(short_dir)
    path = short_dir / "tls.sock"
    tls = ServerTLS(str(pki.server_cert), str(pki.server_key), str(pki.ca))

    async def run() -> tuple[bool, ...]:
        built = assemble("test", "grpc.health.v1.Health", lambda server: None, "127.0.0.1", 0, tls, uds=str(path))
        await built.server.start()
        await built.health.set(True)
        named = ChannelTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key), server_name="localhost")
        unnamed = ChannelTLS(str(pki.ca), str(pki.client_cert), str(pki.client_key))
        anonymous = ChannelTLS(str(pki.ca), server_name="localhost")
        results = await asyncio.gather(*(asyncio.to_thread(check, uds.target(str(path)), "", 5.0, tls)
                                         for tls in (named, unnamed, anonymous)))
        await built.server.stop(0)
        return tuple(results)

    assert asyncio.run(run()) == (True, False, False)
