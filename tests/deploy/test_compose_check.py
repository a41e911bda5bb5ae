"""scripts/container_engine.py, the engine finding of `make compose-check` (the check itself runs the compose file
for real: `make compose-check`, after the tests in CI): an engine is recognised by its Docker API answer, the
podman settings follow this machine's limits."""

from __future__ import annotations

import http.server
import json
import pathlib
import socketserver
import threading
from collections.abc import Iterator

import pytest

from scripts import container_engine
from scripts.container_engine import engine_name, find_engine, podman_settings


class UnixHttpServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def serve_version(path: pathlib.Path, body: dict) -> UnixHttpServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            payload = json.dumps(body).encode() if self.path == "/version" else b"{}"
            self.send_response(200 if self.path == "/version" else 404)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def address_string(self) -> str:  # a unix socket has no (host, port)
            return "unix"

        def log_message(self, *args: object) -> None:
            pass

    server = UnixHttpServer(str(path), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def podman_api(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    path = tmp_path / "podman.sock"
    server = serve_version(path, {"Components": [{"Name": "Podman Engine", "Version": "4.3.1"}], "Version": "4.3.1"})
    yield path
    server.shutdown()
    server.server_close()


def test_an_engine_is_named_by_its_version_answer_and_nothing_answers_on_a_dead_socket(
        podman_api: pathlib.Path, tmp_path: pathlib.Path) -> None:
    assert engine_name(f"unix://{podman_api}") == "Podman Engine"
    assert engine_name(f"unix://{tmp_path / 'nothing.sock'}") is None
    assert engine_name("ssh://somewhere") is None


def test_the_engine_that_runs_is_used_as_it_is(podman_api: pathlib.Path, tmp_path: pathlib.Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(container_engine, "DOCKER_SOCKET", tmp_path / "no-docker.sock")
    monkeypatch.setattr(container_engine, "PODMAN_SOCKET", tmp_path / "no-podman.sock")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{podman_api}")
    engine = find_engine()
    assert engine is not None and (engine.kind, engine.docker_host, engine.service) == (
        "podman", f"unix://{podman_api}", None)
    monkeypatch.delenv("DOCKER_HOST")
    assert find_engine() is None  # then compose-check installs podman (root) or says how to start an engine


def test_podman_settings_keep_this_machines_open_file_limit() -> None:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    settings = podman_settings()
    assert f'"nofile={hard}:{hard}"' in settings or hard == resource.RLIM_INFINITY
    assert 'runtime = "runc"' in settings and 'cgroup_manager = "cgroupfs"' in settings


def test_the_changes_to_this_machine_are_listed_before_any_is_made(tmp_path: pathlib.Path) -> None:
    from scripts.container_engine import CONTAINERS_CONF, planned_changes

    conf = tmp_path / "containers.conf"
    fresh = planned_changes(podman="", conf=conf)
    assert len(fresh) == 3
    assert "apt-get" in fresh[0] and str(conf) in fresh[1] and "podman's Docker API service" in fresh[2]
    conf.write_text("# the operator's own\n")
    assert not any(str(conf) in change for change in planned_changes(podman="", conf=conf))  # never overwritten
    installed = planned_changes(podman="/usr/bin/podman", conf=conf)
    assert len(installed) == 1 and "API service" in installed[0]
    assert str(CONTAINERS_CONF) == "/etc/containers/containers.conf"


def test_start_podman_says_what_it_will_change_before_changing_anything(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """As root with no podman: the first thing it does is list the changes (the install is stopped right there)."""
    class Stop(Exception):
        pass

    def no_install(packages: list[str], why: str) -> None:
        raise Stop
    monkeypatch.setattr(container_engine.os, "geteuid", lambda: 0)
    monkeypatch.setattr(container_engine.shutil, "which", lambda name: None)
    monkeypatch.setattr(container_engine, "CONTAINERS_CONF", tmp_path / "containers.conf")
    monkeypatch.setattr(container_engine, "apt_install", no_install)
    with pytest.raises(Stop):
        container_engine.start_podman(tmp_path)
    out = capsys.readouterr().out
    assert "this check will change this machine" in out and "containers.conf" in out and "API service" in out
    assert not (tmp_path / "containers.conf").exists()


def test_each_run_is_its_own_compose_project() -> None:
    from scripts.compose_check import Compose, project_name
    from scripts.container_engine import Engine

    assert project_name(101) != project_name(102) and project_name().startswith("grok-serve-check-")
    compose = Compose("/bin/echo", Engine("unix:///nowhere.sock", "docker"), project_name(101))
    assert compose("ps", capture=True).split()[:2] == ["-p", "grok-serve-check-101"]
