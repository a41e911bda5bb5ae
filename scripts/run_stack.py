"""Run the whole stack on this machine: tokenizer, model and gateway on 127.0.0.1 (what `make run` calls).

With --uds-dir DIR they listen on unix socket files in DIR instead and no TCP port is opened
(scripts/stack_endpoints.py).

Starts the three services (the embedded demo by default: demo/tokenizer.model, demo/config.json,
demo/checkpoint; --config/--checkpoint/--tokenizer/--dtype/--mesh select real weights), waits
until each is SERVING, streams one sample completion through the client, prints grpcurl commands to try,
then keeps serving, forwarding the services' logs, until Ctrl-C, SIGTERM or SIGHUP (the terminal closed)
stops all three cleanly. Each service is started through serving_common.with_parent, so it also stops
when this launcher dies without stopping it (SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make the repo's packages importable

from gateway.client import GatewayClient  # noqa: E402
from gateway.client.__main__ import stream  # noqa: E402
from serving_common.flags import EnvArgumentParser, port, positive_int  # noqa: E402
from serving_common.healthcheck import check  # noqa: E402
from serving_common.logs import resolve_format  # noqa: E402
from serving_common.processes import free_port, start_module, terminate  # noqa: E402
from scripts.stack_endpoints import (Listener, add_socket_flags, listener, model_metrics_socket,  # noqa: E402
                                     port_unused, prepare_directory, remove_directory, remove_left_sockets,
                                     resolve_socket_flags, unusable_sockets)
from scripts.stack_flags import PassThrough, add_service_flags, service_args  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = EnvArgumentParser(env_prefix="GROK_STACK", prog="scripts/run_stack.py", description=__doc__.split("\n")[0],
                          allow_abbrev=False)  # a service flag mistyped is an error, never another flag
    p.add_env_argument("--config", default="demo/config.json", help="model preset or config JSON")
    p.add_env_argument("--checkpoint", default="demo/checkpoint", help="directory holding ckpt-0/")
    p.add_env_argument("--tokenizer", default="demo/tokenizer.model", help="SentencePiece model file")
    p.add_env_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_env_argument("--mesh", default="1,1", help="device mesh DATA,MODEL (e.g. 1,8 for Grok-1 on 8 GPUs)")
    p.add_env_argument("--slots", type=positive_int, default=4, help="model batch slots")
    p.add_env_argument("--compile-cache", default=".jax_cache", help="JAX compilation cache ('' disables)")
    p.add_env_argument("--host", default="127.0.0.1", help="address the three services bind")
    p.add_env_argument("--gateway-port", type=port, default=50051, help="gateway gRPC port (0: a free one)")
    p.add_env_argument("--http-port", type=port, default=8000, help="gateway OpenAI-compatible HTTP port (0: off)")
    p.add_env_argument("--tokenizer-port", type=port, default=50052, help="tokenizer gRPC port (0: a free one)")
    p.add_env_argument("--model-port", type=port, default=50053, help="model gRPC port (0: a free one)")
    p.add_env_argument("--metrics-port", type=port, default=None,
                       help="gateway Prometheus port (0: off; if not given 9090, off with --uds-dir)")
    p.add_env_argument("--model-metrics-port", type=port, default=None,
                       help="model Prometheus port (0: off; if not given 9091, or with --uds-dir the socket file "
                            "DIR/model-metrics.sock, which the gateway's /metrics then includes)")
    add_socket_flags(p)
    p.add_env_argument("--prompt", default="The model service owns",
                       help="prompt of the sample completion")
    p.add_env_argument("--max-tokens", type=positive_int, default=48, help="tokens of the sample completion")
    p.add_env_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for SERVING")
    p.add_env_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_env_argument("--log-format", default="auto", choices=["auto", "text", "json"],
                       help="the three services' log lines: text, JSON, or auto (text when this terminal shows them)")
    p.add_env_argument("--api-key", default="", help="require 'authorization: Bearer KEY' at the gateway "
                       "(the sample and the commands printed send it)")
    passes = add_service_flags(p)
    args = p.parse_args(argv)
    args.passes = passes
    resolve_socket_flags(args)
    return args


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def say(out: TextIO, text: str) -> None:
    """Write to the terminal, which may be gone (SIGHUP): then the text is dropped."""
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):
        pass


class LogGate:
    """Writes the services' log lines to `out`, or keeps them while the sample completion is printed.

    Lines are dropped once the terminal is gone; reading them still keeps the services' pipes flowing.
    """

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.held: list[str] | None = None

    def write(self, line: str) -> None:
        with self.lock:
            if self.held is not None:
                self.held.append(line)
            else:
                say(self.out, line)

    def hold(self) -> None:
        with self.lock:
            self.held = []

    def release(self) -> None:
        with self.lock:
            say(self.out, "".join(self.held or []))
            self.held = None


class Child:
    """One service process (its own session: Ctrl-C reaches only this script); output goes to `logs`.

    It runs under serving_common.with_parent: SIGTERMed by the kernel if this launcher dies first.
    """

    def __init__(self, name: str, args: list[str], logs: LogGate, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.address = ""
        self.proc = start_module(args[0], args[1:], stdout=subprocess.PIPE, cwd=ROOT, with_parent=True,
                                 new_session=True, text=True, env=env)
        self.thread = threading.Thread(target=self._forward, args=(logs,), daemon=True)
        self.thread.start()

    def _forward(self, logs: LogGate) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            logs.write(f"[{self.name}] {line}")

    def stop(self, timeout: float = 30.0) -> int:
        returncode = terminate(self.proc, timeout)
        self.thread.join(5)
        return returncode


def client_key(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str:
    """The key the sample and the printed commands send: --api-key, else one the gateway reads from its own
    variables (GROK_GATEWAY_API_KEY, GROK_GATEWAY_API_KEY_FILE) in this environment or from --api-key-file,
    else none."""
    if args.api_key:
        return args.api_key
    if keys := environ.get("GROK_GATEWAY_API_KEY", ""):
        return keys.split(",")[0].strip()
    if key_file := (getattr(args, "gateway_api_key_file", "") or getattr(args, "api_key_file", "")
                    or environ.get("GROK_GATEWAY_API_KEY_FILE", "")):
        try:
            lines = pathlib.Path(key_file).read_text().splitlines()
        except OSError:
            return ""  # the gateway will refuse to start, naming the file
        return next((line.strip() for line in lines if line.strip() and not line.startswith("#")), "")
    return ""


def start(args: argparse.Namespace, out: LogGate) -> list[Child]:
    log_format = resolve_format(args.log_format, sys.stdout)  # the services write into a pipe: decide here
    host, level = args.host, ["--log-level", args.log_level, "--log-format", log_format]
    passes: tuple[PassThrough, ...] = args.passes
    where = {name: listener(args, name) for name in ("tokenizer", "model", "gateway", "http")}
    tokenizer = Child("tokenizer", ["tokenizer_service", "--model", args.tokenizer, *where["tokenizer"].args, *level,
                                    *service_args(args, passes, "tokenizer")], out)
    tokenizer.address = where["tokenizer"].address
    cache = ["--compile-cache", args.compile_cache] if args.compile_cache else []
    metrics_socket = model_metrics_socket(args)
    metrics = ["--metrics-uds", metrics_socket] if metrics_socket else ["--metrics-port", str(args.model_metrics_port)]
    # --tokenizer: the model service then serves structured output (constraints are compiled over its pieces).
    model = Child("model", ["model_service", "--config", args.config, "--checkpoint", args.checkpoint,
                            "--tokenizer", args.tokenizer, "--dtype", args.dtype, "--mesh", args.mesh,
                            "--slots", str(args.slots), *where["model"].args,
                            *metrics, *cache, *level,
                            *service_args(args, passes, "model")], out)
    model.address = where["model"].address
    # The gateway's /metrics (HTTP API and --metrics-port) carries the model's series too.
    url_host = f"[{host}]" if ":" in host else host
    model_metrics = (["--model-metrics", f"http://{url_host}:{args.model_metrics_port}/metrics"]
                     if args.model_metrics_port else ["--model-metrics", f"unix:{metrics_socket}"] if metrics_socket
                     else [])
    gateway = Child("gateway", ["gateway", "--tokenizer", tokenizer.address, "--model", model.address,
                                *where["gateway"].args, *where["http"].args, "--host", host,  # --host: /metrics
                                "--metrics-port", str(args.metrics_port), *level, *model_metrics,
                                *service_args(args, passes, "gateway")], out,
                    env={"GROK_GATEWAY_API_KEY": args.api_key} if args.api_key else None)  # not on a command line
    gateway.address = where["gateway"].address
    for child in (tokenizer, model, gateway):
        out.write(f"run_stack: started {child.name} (pid {child.proc.pid}) for {child.address}\n")
    if where["http"].on_socket:
        out.write(f"run_stack: the gateway's HTTP API listens on {where['http'].address}\n")
    return [tokenizer, model, gateway]


PORT_FLAGS = ("gateway_port", "http_port", "tokenizer_port", "model_port", "metrics_port", "model_metrics_port")
GRPC_PORT_FLAGS = ("gateway_port", "tokenizer_port", "model_port")  # 0 picks a free one; for the others 0 is off


def choose_free_ports(args: argparse.Namespace) -> None:
    """Give each gRPC port flag left at 0 a free port: the gateway must be told where the tokenizer and the model
    listen before they start, so the launcher picks their ports rather than the services."""
    for name in GRPC_PORT_FLAGS:
        if getattr(args, name) == 0 and not port_unused(args, name):
            setattr(args, name, free_port())


PROGRESS_EVERY = 15.0  # seconds between "still waiting" lines


def can_bind(host: str, number: int) -> bool:
    """Whether `host:number` is free to listen on (another listener, whoever it is, makes it taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket's TIME_WAIT is no listener
        try:
            probe.bind((host, number))
        except OSError:
            return False
    return True


def taken_ports(args: argparse.Namespace) -> list[str]:
    """The stack's ports that something else listens on already, each as its flag and number."""
    return [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in PORT_FLAGS
            if getattr(args, name) and not port_unused(args, name) and not can_bind(args.host, getattr(args, name))]


def refuse_taken(taken: list[str], host: str, out: TextIO) -> None:
    flag, number = taken[0].split()
    say(out, f"run_stack: {host}:{number} ({flag}) is already in use by another process (a stack still "
             f"running?); nothing was started. Stop that process, or choose other ports, e.g. "
             f'make run ARGS="{flag} {int(number) + 10}"\n')
    for more in taken[1:]:
        say(out, f"run_stack: also in use: {more}\n")


def wait_serving(children: list[Child], timeout: float, stop: threading.Event, out: TextIO) -> bool:
    """Poll each child's health until SERVING; a line every PROGRESS_EVERY seconds says what is still starting."""
    start = time.monotonic()
    deadline, next_note = start + timeout, start + PROGRESS_EVERY
    pending = list(children)
    say(out, "run_stack: waiting for the three services to report SERVING (the model service loads its weights "
             "and compiles its programs first; compiled programs are kept in the compile cache for next time)\n")
    while pending and time.monotonic() < deadline and not stop.is_set():
        for child in list(pending):
            if child.proc.poll() is not None:
                say(out, f"run_stack: {child.name} exited with {child.proc.returncode} before serving\n")
                return False
            if check(child.address, timeout=1.0):
                say(out, f"run_stack: {child.name} is SERVING on {child.address} "
                         f"({time.monotonic() - start:.0f} s)\n")
                pending.remove(child)
        if pending and time.monotonic() >= next_note:
            next_note += PROGRESS_EVERY
            say(out, f"run_stack: still starting after {time.monotonic() - start:.0f} s: "
                     f"{', '.join(c.name for c in pending)}\n")
        stop.wait(0.5)
    if pending and not stop.is_set():
        say(out, f"run_stack: not SERVING after {timeout:.0f}s: {', '.join(c.name for c in pending)}\n")
    return not pending


def tool(name: str, fallback: pathlib.Path) -> str:
    """How to call a command from the repo root: by name when PATH has the venv's, else by path."""
    found = shutil.which(name)
    if found and (name != "python" or pathlib.Path(found).absolute() == fallback.absolute()):
        return name
    try:
        return str(fallback.relative_to(ROOT))
    except ValueError:
        return str(fallback)


def try_commands(args: argparse.Namespace, gateway: Listener, http: Listener) -> list[str]:
    """The commands `make run` suggests, runnable as printed (with the API key's header when one is set); on unix
    sockets grpcurl's -unix and curl's --unix-socket forms."""
    python, grpcurl = tool("python", pathlib.Path(sys.executable)), tool("grpcurl", ROOT / ".venv" / "bin" / "grpcurl")
    secret = client_key(args)
    key = ["--api-key", secret] if secret else []
    header = ["-H", f"authorization: Bearer {secret}"] if secret else []
    body = json.dumps({"prompt": args.prompt, "sampling": {"max_tokens": args.max_tokens}})
    target = ["-unix", gateway.path] if gateway.path else [gateway.address]
    commands = [[python, "-m", "gateway.client", args.prompt, "--max-tokens", "32", "--address", gateway.address, *key],
                [grpcurl, "-plaintext", *header, "-d", body, *target, "grok.gateway.v1.GatewayService/Generate"],
                [grpcurl, "-plaintext", *header, *target, "list"]]
    if http.address:
        via, url = (["--unix-socket", http.path], "http://localhost/v1") if http.path else ([], f"{http.address}/v1")
        json_header = ["-H", "content-type: application/json", *header]
        completion = json.dumps({"prompt": args.prompt, "max_tokens": args.max_tokens, "stream": True})
        chat = json.dumps({"messages": [{"role": "user", "content": "What does the gateway do?"}],
                           "temperature": 0, "max_tokens": 64})
        commands += [["curl", "-sN", *via, f"{url}/completions", *json_header, "-d", completion],
                     ["curl", "-s", *via, f"{url}/chat/completions", *json_header, "-d", chat]]
    return [shlex.join(command) for command in commands]


def sample(args: argparse.Namespace, gateway: Listener, http: Listener, out: TextIO) -> int:
    out.write(f"\nrun_stack: sample completion of {args.prompt!r} (streamed as it arrives):\n")
    request = argparse.Namespace(prompt=args.prompt, max_tokens=args.max_tokens, temperature=0.0, top_p=None,
                                 seed=None, stop=[], ignore_eos=False, top_k=None, min_p=None,
                                 repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
                                 timeout=600.0, quiet=False)
    with GatewayClient(gateway.address, api_key=client_key(args) or None) as client:
        code = stream(client, request, out, out)
    out.write("\nrun_stack: try it yourself:\n" + "".join(f"  {c}\n" for c in try_commands(args, gateway, http))
              + "run_stack: serving; Ctrl-C stops all three services.\n")
    out.flush()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stdout
    stop = threading.Event()

    def interrupt(*_: object) -> None:
        stop.set()
        raise KeyboardInterrupt  # also leaves a blocking call such as the sample completion

    for sig in STOP_SIGNALS:
        signal.signal(sig, interrupt)
    choose_free_ports(args)
    if taken := taken_ports(args):  # before anything starts: a SERVING answer must come from this stack
        refuse_taken(taken, args.host, out)
        return 1
    created = prepare_directory(args)
    if unusable := unusable_sockets(args):  # in use, stale or not a socket: never taken over
        say(out, "".join(f"run_stack: {problem}\n" for problem in unusable) + "run_stack: nothing was started\n")
        remove_directory(args, created)
        return 1
    logs = LogGate(out)
    children = start(args, logs)
    code = 0
    try:
        if not wait_serving(children, args.startup_timeout, stop, out):
            code = 0 if stop.is_set() else 1
        else:
            logs.hold()
            try:
                code = sample(args, listener(args, "gateway"), listener(args, "http"), out)
            finally:
                logs.release()
        if code == 0 and not stop.is_set():
            while not stop.is_set() and all(c.proc.poll() is None for c in children):
                stop.wait(0.5)
            if not stop.is_set():
                say(out, "run_stack: a service exited unexpectedly; stopping the others\n")
                code = 1
    except KeyboardInterrupt:
        pass
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda *_: stop.set())  # a second Ctrl-C must not cut the shutdown short
        say(out, "run_stack: stopping gateway, model, tokenizer\n")
        for child in reversed(children):
            returncode = child.stop()
            say(out, f"run_stack: {child.name} exited with {returncode}\n")
            code = code or (0 if returncode == 0 else 1)
        for path in remove_left_sockets(args, created):
            say(out, f"run_stack: removed {path}, left by a service that did not stop cleanly\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
