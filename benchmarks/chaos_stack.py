"""The local stack a chaos run attacks: tokenizer, model replicas and gateway as child processes.

Each service keeps its port across restarts (so the gateway reconnects without being restarted),
logs JSON to a file, and can be killed (SIGKILL), stopped (SIGTERM) and started again. Model replicas
share one JAX compilation cache, so a restarted replica compiles nothing.
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from serving_common.healthcheck import check
from serving_common.processes import free_port, start_module, terminate, wait_serving

ROOT = pathlib.Path(__file__).resolve().parent.parent


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (0 when it is gone)."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Proc:
    """One service: `python -m module args` on a fixed port; restartable."""

    def __init__(self, name: str, module: str, args: Sequence[str], port: int, log_dir: pathlib.Path) -> None:
        self.name = name
        self.module = module
        self.args = list(args)
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> "Proc":
        self.starts += 1
        log = open(self.log_dir / f"{self.name}.{self.starts}.log", "wb")  # noqa: SIM115 - the child owns it
        self.proc = start_module(self.module, self.args, stdout=log, cwd=ROOT)
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def serving(self) -> bool:
        return check(self.address, timeout=1.0)

    def wait_serving(self, timeout: float = 600.0) -> float:
        """Seconds until the service reported SERVING."""
        assert self.proc is not None, "start() it first"
        return wait_serving(self.proc, self.address, timeout, name=self.name, interval=0.05,
                            log_tail=lambda: f"; see {self.log_dir}")

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (drain), SIGKILL after `timeout`; the exit code."""
        assert self.proc is not None
        return terminate(self.proc, timeout)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{self.name}.*.log")))


@dataclass(frozen=True)
class StackConfig:
    """What to serve and how big the model's admission is."""

    config: str
    checkpoint: str
    tokenizer: str
    replicas: int = 2
    slots: int = 2
    max_queue: int = 4
    compile_cache: str = ".jax_cache"
    grace_seconds: float = 5.0
    watchdog_seconds: float = 30.0
    model_flags: tuple[str, ...] = ()  # more flags for every model replica (e.g. --speculative-config JSON)
    gateway_flags: tuple[str, ...] = ()  # more flags for the gateway (e.g. --model-retry-seconds)


class LocalStack:
    """tokenizer + model replicas + gateway on 127.0.0.1."""

    def __init__(self, config: StackConfig, log_dir: pathlib.Path) -> None:
        self.config = config
        self.log_dir = log_dir
        grace = ["--grace-seconds", str(config.grace_seconds)]
        tokenizer_port = free_port()
        self.tokenizer = Proc("tokenizer", "tokenizer_service", ["--model", config.tokenizer, "--host", "127.0.0.1",
                                                                 "--port", str(tokenizer_port), *grace],
                              tokenizer_port, log_dir)
        self.models = []
        for i in range(config.replicas):
            port, metrics = free_port(), free_port()
            self.models.append(Proc(f"model{i}", "model_service", [
                "--config", config.config, "--checkpoint", config.checkpoint, "--host", "127.0.0.1",
                "--port", str(port), "--metrics-port", str(metrics), "--slots", str(config.slots),
                "--max-queue", str(config.max_queue),
                "--compile-cache", config.compile_cache, "--watchdog-seconds", str(config.watchdog_seconds),
                *grace, *config.model_flags], port, log_dir))
        gateway_port = free_port()
        self.gateway = Proc("gateway", "gateway", [
            "--tokenizer", self.tokenizer.address, "--model", ",".join(m.address for m in self.models),
            "--host", "127.0.0.1", "--port", str(gateway_port), "--http-port", "0", *grace, *config.gateway_flags],
            gateway_port, log_dir)

    @property
    def services(self) -> list[Proc]:
        return [self.tokenizer, *self.models, self.gateway]

    def metrics_port(self, model: Proc) -> int:
        return int(model.args[model.args.index("--metrics-port") + 1])

    def start(self, timeout: float = 1800.0) -> "LocalStack":
        for proc in self.services:
            proc.start()
        try:
            for proc in self.services:
                proc.wait_serving(timeout)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for proc in reversed(self.services):
            codes[proc.name] = proc.terminate() if proc.proc is not None else None
        return codes
