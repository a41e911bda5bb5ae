"""scripts/run_stack.py (what `make run` runs): starts the three services, streams a sample, stops on Ctrl-C,
on SIGHUP (the terminal closed) and, through the children themselves, when the launcher is killed."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

from scripts.run_stack import client_key, parse_args
from serving_common.healthcheck import check
from tests.demo.launcher import Launched
from tests.demo.test_readme import code_blocks, on_stack, shell_commands
from tests.procs import GOLDEN, ROOT, free_port, grpcurl_path
from tests.test_uds_stack import inet_sockets
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def test_run_stack_serves_streams_a_sample_and_stops_all_three_on_ctrl_c(jax_cache: str) -> None:
    """With an API key set, the sample, every command the launcher prints and docs/security.md's API-key examples
    work as written; the services' own flags reach them (scripts/stack_flags.py)."""
    launched = Launched(["--config", str(GOLDEN / "config.json"), "--checkpoint", str(GOLDEN / "checkpoint"),
                         "--tokenizer", str(GOLDEN / "tokenizer.model"), "--compile-cache", jax_cache,
                         "--max-tokens", "6", "--prompt", "In the beginning", "--served-model-name", "golden-mini",
                         "--model-log-level", "debug"],
                        env={"GROK_STACK_API_KEY": "sk-mykey"})  # docs/security.md's key
    try:
        launched.wait_ready()
        output = launched.output()
        assert "[finish: length; tokens: 8 prompt + 6 completion" in output
        commands = re.findall(r"^  (.+)$", output.split("run_stack: try it yourself:\n", 1)[1], re.M)
        assert [c.split()[0].rsplit("/", 1)[-1] for c in commands] == ["python", "grpcurl", "grpcurl", "curl", "curl"]
        for command in commands:
            done = subprocess.run(["bash", "-c", command.replace("grpcurl ", f"{grpcurl_path()} ", 1)
                                   if command.startswith("grpcurl ") else command],
                                  cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and done.stdout.strip() and '{"error"' not in done.stdout, (command, done)
        (block, *_) = code_blocks((ROOT / "docs" / "security.md").read_text(encoding="utf-8"), "bash")
        for command in shell_commands(block):  # its API-key examples, as written
            done = subprocess.run(["bash", "-c", on_stack(command, launched)], cwd=ROOT, capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0 and '"error"' not in done.stdout, (command, done)
        without_key = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                      f"{launched.http_url}/v1/models"], capture_output=True, text=True, timeout=30)
        assert without_key.stdout == "401"
        models = subprocess.run(["curl", "-s", f"{launched.http_url}/v1/models", "-H", "authorization: Bearer sk-mykey"],
                                capture_output=True, text=True, timeout=30)
        assert [m["id"] for m in json.loads(models.stdout)["data"]] == ["golden-mini"]  # --served-model-name
        assert '"level": "debug"' in launched.models[0].logs()  # --model-log-level: the model's alone
        assert '"level": "debug"' not in launched.gateway.logs()
        for service in (launched.tokenizer, *launched.models, launched.gateway):  # each froze its startup heap
            records = [json.loads(line) for line in service.logs().splitlines() if line.startswith("{")]
            serving = [r for r in records if r.get("msg") == "serving"]
            assert serving and all(r.get("frozen_objects", 0) > 0 for r in serving), (service.name, serving)
        ports = [launched.ports[name] for name in ("gateway", "tokenizer", "model")]
        assert all(check(f"127.0.0.1:{p}") for p in ports)
        assert launched.stop() == 0
    finally:
        if launched.proc.poll() is None:
            launched.kill()
    output = launched.output()
    for name in ("gateway", "model", "tokenizer"):
        assert f"run_stack: {name} exited with 0" in output
    assert not any(check(f"127.0.0.1:{p}", timeout=0.5) for p in ports)


def test_a_port_in_use_is_refused_before_anything_starts() -> None:
    with socket.socket() as other:  # another process's server on the gateway's port
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        done = subprocess.run([sys.executable, "scripts/run_stack.py", "--gateway-port", str(taken),
                               "--tokenizer-port", str(free_port()), "--model-port", str(free_port()),
                               "--http-port", "0", "--metrics-port", "0", "--model-metrics-port", "0"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"127.0.0.1:{taken} (--gateway-port) is already in use" in done.stdout
    assert "SERVING" not in done.stdout and "run_stack: started" not in done.stdout


def test_make_run_passes_its_args_to_the_launcher_and_installs_only_what_serving_needs(tmp_path: pathlib.Path) -> None:
    """`make run ARGS=...` reaches the launcher; on a fresh venv it installs the serving packages (and the clients
    the README calls) with pip's progress shown, not the test tools nor npm."""
    done = subprocess.run(["make", "--no-print-directory", "-n", "run", f"VENV={tmp_path / 'venv'}", "ARGS=--http-port 8080 --slots 2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    installs = [line for line in lines if "pip install" in line]
    assert installs and not any(" -q" in line for line in installs), installs
    assert any("'.[client]'" in line for line in installs) and not any("test]" in line for line in installs)
    build = next(i for i, line in enumerate(lines) if "-e '.[client]'" in line)  # the silent kernel compile
    assert "compiles its native int8 kernels (C++): pip shows no progress" in lines[build - 1], lines[build - 2:build + 1]
    assert not any("npm" in line for line in lines)
    assert lines[-1].endswith("scripts/run_stack.py --http-port 8080 --slots 2")


class Launcher:
    """run_stack.py in its own process group (as a terminal runs it), its output collected."""

    def __init__(self, jax_cache: str, extra: tuple[str, ...] = (), tcp: bool = True) -> None:
        self.ports: list[int] = []  # gateway, tokenizer, model: port 0 asks the launcher for free ones
        self.tcp = tcp  # False: no port flags at all (extra has --uds-dir)
        ports = ["--gateway-port", "0", "--tokenizer-port", "0", "--model-port", "0", "--metrics-port", "0",
                 "--model-metrics-port", "0", "--http-port", "0"] if tcp else []
        self.proc = subprocess.Popen(
            [sys.executable, "scripts/run_stack.py", "--config", str(GOLDEN / "config.json"),
             "--checkpoint", str(GOLDEN / "checkpoint"), "--tokenizer", str(GOLDEN / "tokenizer.model"),
             *ports, "--startup-timeout", "300",
             "--compile-cache", jax_cache, "--max-tokens", "2", "--prompt", "In the beginning", *extra],
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
        if not self.tcp:
            return [int(pid) for pid in re.findall(r"\(pid (\d+)\)", self.output())]
        started = dict(re.findall(r"started (\w+) \(pid \d+\) for 127\.0\.0\.1:(\d+)", self.output()))
        self.ports = [int(started[name]) for name in ("gateway", "tokenizer", "model")]
        assert 0 not in self.ports and all(check(f"127.0.0.1:{p}") for p in self.ports), self.output()[-4000:]
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
    """(With --log-format text: the three services' lines are text, not JSON.)"""
    launcher = Launcher(jax_cache, ("--log-format", "text"))
    pids: list[int] = []
    try:
        pids = launcher.wait_serving()
        assert len(pids) == 3
        for name in ("tokenizer", "model", "gateway"):
            lines = [line for line in launcher.output().splitlines() if line.startswith(f"[{name}] ")]
            assert lines and all(re.match(r"\[\w+\] \d\d:\d\d:\d\d\.\d{3} [A-Z]+ ", line) for line in lines
                                 if not line.startswith(f"[{name}]  ")), lines[:5]
        os.killpg(launcher.proc.pid, signal.SIGHUP)  # what the terminal sends its process group
        launcher.proc.wait(60)
        wait_until(lambda: not any(alive(pid) for pid in pids), 30, interval=0.2,
                   message=lambda: f"services outlived the launcher:\n{launcher.output()[-3000:]}")
        assert not any(check(f"127.0.0.1:{p}", timeout=0.5) for p in launcher.ports)
    finally:
        launcher.cleanup(pids)


def test_uds_dir_serves_on_socket_files_only_and_ctrl_c_removes_them(jax_cache: str) -> None:
    """`--uds-dir DIR` (make run ARGS="--uds-dir /tmp/grok"): the three services on DIR's socket files, health and
    the sample over them, no TCP or UDP socket in any of the four processes (metrics off by default), every printed
    command works as printed, and Ctrl-C stops all three and removes the files and the directory it made."""
    with tempfile.TemporaryDirectory(prefix="grok-run", dir="/tmp") as name:  # short: a socket path has <= 107 bytes
        directory = pathlib.Path(name) / "grok"  # the launcher creates it
        launcher = Launcher(jax_cache, ("--uds-dir", str(directory)), tcp=False)
        pids: list[int] = []
        try:
            pids = launcher.wait_serving()
            output = launcher.output()
            assert len(pids) == 3 and "[finish: length; tokens: 8 prompt + 2 completion" in output, output[-3000:]
            for service in ("tokenizer", "model", "gateway"):
                assert f"run_stack: {service} is SERVING on unix:{directory}/{service}.sock" in output
            files = sorted(p.name for p in directory.iterdir())
            assert files == ["gateway.sock", "http.sock", "model-metrics.sock", "model.sock", "tokenizer.sock"]
            assert all(stat.S_ISSOCK(os.lstat(directory / f).st_mode) for f in files)
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700
            # /metrics without TCP: the gateway's, on its HTTP socket, carries the model's (scraped from its socket).
            scraped = subprocess.run(["curl", "-s", "--unix-socket", str(directory / "http.sock"),
                                      "http://localhost/metrics"], capture_output=True, text=True, timeout=60)
            replica = f'replica="unix:{directory}/model-metrics.sock"'
            assert f"grok_gateway_model_metrics_up{{{replica}}} 1.0" in scraped.stdout, scraped
            for pid in (*pids, launcher.proc.pid):
                assert inet_sockets(pid) == [], (pid, launcher.output()[-3000:])
            commands = re.findall(r"^  (.+)$", output.split("run_stack: try it yourself:\n", 1)[1], re.M)
            assert len(commands) == 5 and "127.0.0.1" not in "".join(commands), commands
            assert all("-unix" in c for c in commands[1:3]) and all("--unix-socket" in c for c in commands[3:])
            for command in commands:
                done = subprocess.run(["bash", "-c", command.replace("grpcurl ", f"{grpcurl_path()} ", 1)
                                       if command.startswith("grpcurl ") else command],
                                      cwd=ROOT, capture_output=True, text=True, timeout=120)
                assert done.returncode == 0 and done.stdout.strip() and '{"error"' not in done.stdout, (command, done)
            os.killpg(launcher.proc.pid, signal.SIGINT)  # Ctrl-C in its terminal
            assert launcher.proc.wait(90) == 0, launcher.output()[-3000:]
        finally:
            launcher.cleanup(pids)
        output = launcher.output()
        for service in ("gateway", "model", "tokenizer"):
            assert f"run_stack: {service} exited with 0" in output
        assert not directory.exists(), list(directory.iterdir())


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


def test_the_sample_sends_the_key_the_gateway_reads_from_its_own_variables(tmp_path: pathlib.Path) -> None:
    """A GROK_GATEWAY_API_KEY (or key file) in the environment reaches the gateway the launcher starts: the sample
    must send it, or the stack stops itself on its own UNAUTHENTICATED sample."""
    args = parse_args([])
    assert client_key(args, {}) == ""
    assert client_key(args, {"GROK_GATEWAY_API_KEY": "sk-a,sk-b"}) == "sk-a"
    keys = tmp_path / "keys"
    keys.write_text("# ours\n\nsk-file\nsk-other\n")
    assert client_key(args, {"GROK_GATEWAY_API_KEY_FILE": str(keys)}) == "sk-file"
    assert client_key(parse_args(["--api-key", "sk-flag"]), {"GROK_GATEWAY_API_KEY": "sk-a"}) == "sk-flag"
