"""Start the serving stack for a benchmark: tokenizer, model and gateway processes on 127.0.0.1.

Presets name the two configurations the project reports (docs/benchmarks.md):
- `golden`: ../shared/golden (tiny Grok-1 architecture, its checkpoint and its 512-piece tokenizer);
- `medium`: ../shared/bench/medium.json (Grok-1 architecture scaled down, vocabulary 131,072) with
  random int8 weights and the real Grok-1 tokenizer from ../shared/grok1-tokenizer;
- `demo`: the embedded demo model `make run` serves (demo/config.json, demo/), in the repository.
Each service runs as `python -m <service>` exactly as deployed, on free ports, or (`uds_dir`) on unix socket
files in that directory (`--uds`, `--http-uds`: the way the stack runs on a host without TCP); logs go to files.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from serving_common.processes import Endpoint, free_port, start_module, tcp_endpoint, terminate, unix_endpoint, wait_serving

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


@dataclass(frozen=True)
class StackSpec:
    """What the model service serves and how (everything else is fixed by the preset)."""

    name: str
    config: str
    tokenizer: str
    checkpoint: str | None  # None: --random-init
    slots: int = 8
    dtype: str = "float32"
    max_queue: int = 256
    compile_cache: str | None = None

    def model_args(self) -> list[str]:
        weights = ["--checkpoint", self.checkpoint] if self.checkpoint else ["--random-init"]
        cache = ["--compile-cache", self.compile_cache] if self.compile_cache else []
        return ["--config", self.config, *weights, "--dtype", self.dtype, "--mesh", "1,1", "--slots",
                str(self.slots), "--max-queue", str(self.max_queue), *cache]


def preset(name: str, slots: int = 8, compile_cache: str | None = None) -> StackSpec:
    """The golden or medium stack (see the module docstring)."""
    if name == "golden":
        golden = SHARED / "golden"
        return StackSpec("golden", str(golden / "config.json"), str(golden / "tokenizer.model"),
                         str(golden / "checkpoint"), slots, compile_cache=compile_cache)
    if name == "medium":
        return StackSpec("medium", str(SHARED / "bench" / "medium.json"),
                         str(SHARED / "grok1-tokenizer" / "tokenizer.model"), None, slots,
                         compile_cache=compile_cache)
    if name == "demo":
        return StackSpec("demo", str(ROOT / "demo" / "config.json"), str(ROOT / "demo" / "tokenizer.model"),
                         str(ROOT / "demo" / "checkpoint"), slots, compile_cache=compile_cache)
    raise ValueError(f"unknown stack preset {name!r}: golden, medium or demo")


class Process:
    """One `python -m MODULE` child with its output in a log file."""

    def __init__(self, module: str, args: Sequence[str], log_dir: pathlib.Path, env: dict[str, str] | None = None,
                 port: int | None = None, cwd: pathlib.Path = ROOT, endpoint: Endpoint | None = None) -> None:
        self.module = module
        self.endpoint = endpoint or tcp_endpoint(port)
        self.port = int(self.endpoint.label) if self.endpoint.label.isdigit() else 0  # 0: a unix socket
        self.address = self.endpoint.address
        self.log_path = log_dir / f"{module}_{self.endpoint.label}.log"
        self._log = open(self.log_path, "wb")
        # Its own session, as the launcher users run (scripts/run_stack.py) starts each service: where the
        # kernel groups scheduling by session (sched_autogroup), a stack whose services share the client's
        # session is scheduled differently from the deployed one and measured 13 % faster on golden.
        self.proc = start_module(module, [*args, *self.endpoint.args],
                                 stdout=self._log, cwd=cwd, env=env, with_parent=True, new_session=True)

    def wait_serving(self, timeout: float) -> None:
        wait_serving(self.proc, self.address, timeout, name=self.module, log_tail=lambda: (
            f"; log {self.log_path}:\n{self.log_path.read_text(errors='replace')[-3000:]}"))

    def stop(self) -> int:
        code = terminate(self.proc, 30.0)
        self._log.close()
        return code


@dataclass
class RunningStack:
    """The three started services; `close()` stops them (gateway first)."""

    spec: StackSpec
    tokenizer: Process
    model: Process
    gateway: Process
    http_port: int = 0  # the gateway's OpenAI-compatible API (0: off, or on `http_uds`)
    http_uds: str | None = None  # the gateway's HTTP API socket file (a stack on unix sockets)
    model_metrics: str | None = None  # the model service's /metrics (unix:PATH or an http:// URL)

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.proc.pid for p in (self.tokenizer, self.model, self.gateway))

    def close(self) -> None:
        for proc in (self.gateway, self.model, self.tokenizer):
            proc.stop()


def model_env() -> dict[str, str]:
    # One device, no forced host devices: what the benchmarks measure is the default deployment.
    return {"XLA_FLAGS": os.environ.get("GROK_BENCH_MODEL_XLA_FLAGS", "")}


def use_model_xla_flags() -> None:
    """Give this process the model service's XLA flags and process settings (call in a tool's main, before
    JAX starts), so an engine built in-process is configured like the service it is compared with."""
    os.environ.update(model_env())
    from model_service.__main__ import prepare_process

    prepare_process()


# The benchmarks drive gRPC only. A gateway that also serves HTTP would bind its fixed default HTTP
# port, which a second gateway (a baseline, another engineer's stack) may hold: turn it off by
# environment, which gateways without that flag simply ignore.
GATEWAY_ENV = {"GROK_GATEWAY_HTTP_PORT": "0"}


def endpoint(uds_dir: pathlib.Path | None, name: str) -> Endpoint:
    """A free TCP port on 127.0.0.1, or the socket file `uds_dir/name.sock`."""
    return tcp_endpoint() if uds_dir is None else unix_endpoint(uds_dir, name)


def start_stack(spec: StackSpec, log_dir: pathlib.Path, timeout: float = 1800.0,
                source: pathlib.Path | None = None, http: bool = False,
                uds_dir: pathlib.Path | None = None, gateway_args: Sequence[str] = ()) -> RunningStack:
    """Start tokenizer, model and gateway; return once all three report SERVING. `source`: run the three
    services from another checkout's source tree (e.g. a baseline), with the same preset and compile cache.
    `http`: the gateway also serves its OpenAI-compatible API, on a free port (`RunningStack.http_port`).
    `uds_dir`: every service (and the HTTP API) listens on a unix socket file there instead of TCP."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env: dict[str, str] = {} if source is None else {"PYTHONPATH": str(source)}
    cwd = source or ROOT
    tokenizer = Process("tokenizer_service", ["--model", spec.tokenizer], log_dir, env=env or None, cwd=cwd,
                        endpoint=endpoint(uds_dir, "tokenizer"))
    if uds_dir is None:
        metrics_port = free_port()
        model_metrics, metrics_args = f"http://127.0.0.1:{metrics_port}/metrics", ["--metrics-port", str(metrics_port)]
    else:
        metrics_path = str(uds_dir / "model-metrics.sock")
        model_metrics, metrics_args = f"unix:{metrics_path}", ["--metrics-uds", metrics_path]
    model = Process("model_service", [*spec.model_args(), *metrics_args], log_dir, env={**model_env(), **env},
                    cwd=cwd, endpoint=endpoint(uds_dir, "model"))
    http_port = free_port() if http and uds_dir is None else 0
    http_uds = str(uds_dir / "http.sock") if http and uds_dir is not None else None
    http_args = ["--http-port", str(http_port)] if http_port else ["--http-uds", http_uds] if http_uds else []
    gateway = Process("gateway", ["--tokenizer", tokenizer.address, "--model", model.address, *http_args,
                                  *gateway_args], log_dir,
                      env={**env, **({} if http else GATEWAY_ENV)}, cwd=cwd, endpoint=endpoint(uds_dir, "gateway"))
    stack = RunningStack(spec, tokenizer, model, gateway, http_port, http_uds, model_metrics)
    try:
        for proc in (tokenizer, model, gateway):
            proc.wait_serving(timeout)
    except BaseException:
        stack.close()
        raise
    return stack


def start_gateway(tokenizer: str, model: str, log_dir: pathlib.Path, source: pathlib.Path = ROOT,
                  timeout: float = 120.0, env: dict[str, str] | None = None,
                  endpoint: Endpoint | None = None) -> Process:
    """A gateway in front of running services, run from the source tree `source` (another checkout's
    code, e.g. the main branch, to measure a change against it in one invocation), with `env` added;
    listening on `endpoint` (default: a free TCP port)."""
    gateway = Process("gateway", ["--tokenizer", tokenizer, "--model", model], log_dir, cwd=source,
                      env={"PYTHONPATH": str(source), **GATEWAY_ENV, **(env or {})}, endpoint=endpoint)
    try:
        gateway.wait_serving(timeout)
    except BaseException:
        gateway.stop()
        raise
    return gateway


def start_model(spec: StackSpec, log_dir: pathlib.Path, timeout: float = 1800.0) -> Process:
    """Only the model service (for measurements that bypass the gateway)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    model = Process("model_service", spec.model_args(), log_dir, env=model_env())
    try:
        model.wait_serving(timeout)
    except BaseException:
        model.stop()
        raise
    return model
