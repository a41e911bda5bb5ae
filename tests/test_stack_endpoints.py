"""scripts/stack_endpoints.py: where scripts/run_stack.py's services listen with --uds-dir and the --*-uds flags,
and what the launcher refuses or cleans up there (no service is started here)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from scripts.run_stack import parse_args, taken_ports, try_commands
from scripts.stack_endpoints import listener, remove_left_sockets, unusable_sockets
from scripts.stack_flags import service_args
from tests.procs import ROOT


@pytest.fixture
def short_dir() -> Iterator[pathlib.Path]:
    with tempfile.TemporaryDirectory(prefix="grok-ep", dir="/tmp") as name:  # a socket path has <= 107 bytes
        yield pathlib.Path(name)


def stale_socket(path: pathlib.Path) -> None:
    """A socket file nobody listens on, as a killed service leaves."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))


def test_uds_dir_puts_every_listener_on_its_socket_file_and_the_metrics_ports_off(short_dir: pathlib.Path) -> None:
    args = parse_args(["--uds-dir", str(short_dir)])
    assert (args.metrics_port, args.model_metrics_port) == (0, 0)
    assert [listener(args, n).args for n in ("tokenizer", "model", "gateway", "http")] == [
        ("--uds", f"{short_dir}/tokenizer.sock"), ("--uds", f"{short_dir}/model.sock"),
        ("--uds", f"{short_dir}/gateway.sock"), ("--http-uds", f"{short_dir}/http.sock")]
    assert listener(args, "model").address == f"unix:{short_dir}/model.sock"
    assert all("--uds" not in service_args(args, args.passes, s) for s in ("tokenizer", "model", "gateway"))
    given = parse_args(["--uds-dir", str(short_dir), "--metrics-port", "9190"])  # asked for: opened (TCP)
    assert (given.metrics_port, given.model_metrics_port) == (9190, 0)
    assert (parse_args([]).metrics_port, parse_args([]).model_metrics_port) == (9090, 9091)


def test_one_listener_on_a_socket_and_a_relative_directory_made_absolute(monkeypatch: pytest.MonkeyPatch,
                                                                          short_dir: pathlib.Path) -> None:
    args = parse_args(["--model-uds", str(short_dir / "m.sock")])
    assert listener(args, "model").address == f"unix:{short_dir}/m.sock"
    assert listener(args, "tokenizer").args == ("--host", "127.0.0.1", "--port", "50052")
    assert listener(args, "http").address == "http://127.0.0.1:8000"
    monkeypatch.chdir(short_dir)
    assert parse_args(["--uds-dir", "grok"]).uds_dir == f"{short_dir}/grok"


def test_a_port_in_use_does_not_matter_to_a_listener_on_a_socket(short_dir: pathlib.Path) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = str(other.getsockname()[1])
        assert taken_ports(parse_args(["--gateway-port", taken])) == [f"--gateway-port {taken}"]
        assert taken_ports(parse_args(["--gateway-port", taken, "--uds-dir", str(short_dir)])) == []


def test_printed_commands_use_the_socket_forms(short_dir: pathlib.Path) -> None:
    args = parse_args(["--uds-dir", str(short_dir), "--api-key", "sk-k"])
    commands = try_commands(args, listener(args, "gateway"), listener(args, "http"))
    assert f"--address unix:{short_dir}/gateway.sock --api-key sk-k" in commands[0]
    assert commands[2].endswith(f"-H 'authorization: Bearer sk-k' -unix {short_dir}/gateway.sock list")
    assert f"curl -sN --unix-socket {short_dir}/http.sock http://localhost/v1/completions" in commands[3]


@pytest.mark.parametrize("kind", ["stale", "file"])
def test_a_stale_socket_or_other_file_in_the_directory_is_refused_and_kept(short_dir: pathlib.Path,
                                                                          kind: str) -> None:
    target = short_dir / "model.sock"
    stale_socket(target) if kind == "stale" else target.write_text("mine")
    done = subprocess.run([sys.executable, "scripts/run_stack.py", "--uds-dir", str(short_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done
    reason = "is a stale socket file" if kind == "stale" else "exists and is not a socket"
    assert f"--model-uds: '{target}' {reason}" in done.stdout and "nothing was started" in done.stdout
    assert "run_stack: started" not in done.stdout
    assert target.exists() and sorted(os.listdir(short_dir)) == ["model.sock"]


def test_a_directory_it_creates_is_removed_when_nothing_can_start(short_dir: pathlib.Path) -> None:
    (short_dir / "h").write_text("")
    done = subprocess.run([sys.executable, "scripts/run_stack.py", "--uds-dir", str(short_dir / "new"),
                           "--http-uds", str(short_dir / "h")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "--http-uds" in done.stdout, done
    assert not (short_dir / "new").exists()


def test_sockets_left_by_a_killed_service_are_removed_a_listening_one_kept(short_dir: pathlib.Path) -> None:
    directory = short_dir / "made"
    directory.mkdir()
    args = parse_args(["--uds-dir", str(directory)])
    stale_socket(directory / "model.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(directory / "gateway.sock"))
        server.listen()
        assert unusable_sockets(args) and remove_left_sockets(args, created_directory=True) == [
            str(directory / "model.sock")]
        assert sorted(os.listdir(directory)) == ["gateway.sock"]  # still listening: kept, and the directory too
    os.unlink(directory / "gateway.sock")
    assert remove_left_sockets(args, created_directory=True) == [] and not directory.exists()


def test_the_directory_from_the_environment(monkeypatch: pytest.MonkeyPatch, short_dir: pathlib.Path) -> None:
    monkeypatch.setenv("GROK_STACK_UDS_DIR", str(short_dir))
    args = parse_args([])
    assert listener(args, "tokenizer").address == f"unix:{short_dir}/tokenizer.sock" and args.metrics_port == 0


def test_a_shortened_flag_is_an_error_not_another_flag() -> None:
    """`--uds X` is no launcher flag (the services' --uds is --tokenizer-uds / --model-uds / --gateway-uds): it must
    not be read as --uds-dir X."""
    from scripts.run_stack import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--uds", "/tmp/x.sock"])
