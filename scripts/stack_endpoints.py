"""Where scripts/run_stack.py's three services listen: TCP ports on --host, or unix socket files (--uds-dir).

With `--uds-dir DIR` the tokenizer, model and gateway gRPC servers listen on DIR/tokenizer.sock,
DIR/model.sock and DIR/gateway.sock, the gateway's HTTP API on DIR/http.sock, the model's /metrics on
DIR/model-metrics.sock (`--metrics-uds`, which the gateway scrapes: its /metrics on the HTTP API carries the
model's series), and no TCP port is opened (the metrics ports are off unless given). `--tokenizer-uds`, `--model-uds`,
`--gateway-uds` and `--http-uds PATH` put one listener on a socket file (with or without --uds-dir). The
launcher checks health, wires the gateway (`unix:PATH` targets) and streams its sample over the same
addresses. Socket paths are checked before anything starts (serving_common.uds: in use, stale or not a
socket is refused), and a file a stopped service left behind is removed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import stat
from dataclasses import dataclass

from serving_common.uds import check_free, listening

SOCKET_NAMES = {"tokenizer": "tokenizer.sock", "model": "model.sock", "gateway": "gateway.sock", "http": "http.sock"}
SOCKET_FLAGS = {"tokenizer": "--tokenizer-uds", "model": "--model-uds", "gateway": "--gateway-uds",
                "http": "--http-uds"}
PORT_FLAGS = {"tokenizer": "tokenizer_port", "model": "model_port", "gateway": "gateway_port", "http": "http_port"}
METRICS_DEFAULTS = {"metrics_port": 9090, "model_metrics_port": 9091}  # off with --uds-dir unless given
MODEL_METRICS_SOCKET = "model-metrics.sock"  # the model's /metrics with --uds-dir and no --model-metrics-port


@dataclass(frozen=True)
class Listener:
    """One listener of the stack: the flags that put the service there and what a client dials."""

    address: str  # "HOST:PORT", "unix:PATH"; "" for an HTTP API that is off
    args: tuple[str, ...]  # ("--host", H, "--port", P), ("--uds", PATH), ("--http-port", P), ("--http-uds", PATH)
    path: str | None = None  # the socket file, None on TCP

    @property
    def on_socket(self) -> bool:
        return self.path is not None


def add_socket_flags(p: argparse.ArgumentParser) -> None:
    """The launcher's unix-socket flags (p is an EnvArgumentParser: each also reads GROK_STACK_<FLAG>)."""
    p.add_env_argument("--uds-dir", default="",  # type: ignore[attr-defined]
                       help="serve on unix sockets in this directory (created owner-only if missing) instead of "
                            "TCP: tokenizer.sock, model.sock, gateway.sock, the HTTP API's http.sock and the model's "
                            "/metrics on model-metrics.sock; no TCP port is opened (the metrics ports are off unless "
                            "given)")
    for name, flag in SOCKET_FLAGS.items():
        what = {"http": "the gateway's HTTP API", "gateway": "the gateway's gRPC server"}.get(
            name, f"the {name} service's gRPC server")
        p.add_env_argument(flag, default="", metavar="PATH",  # type: ignore[attr-defined]
                           help=f"unix socket file of {what} (DIR/{SOCKET_NAMES[name]} with --uds-dir; without "
                                "either, its TCP port)")


def resolve_socket_flags(args: argparse.Namespace) -> None:
    """Socket paths made absolute (the services run from the repository's directory, this launcher maybe not);
    a metrics port not given is 9090/9091, or off (0) on --uds-dir: /metrics is TCP only."""
    for dest in ("uds_dir", *(flag[2:].replace("-", "_") for flag in SOCKET_FLAGS.values())):
        if getattr(args, dest):
            setattr(args, dest, os.path.abspath(getattr(args, dest)))
    for dest, default in METRICS_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, 0 if args.uds_dir else default)


def socket_path(args: argparse.Namespace, name: str) -> str | None:
    """The socket file `name` ('tokenizer', 'model', 'gateway', 'http') listens on, None for a TCP port."""
    explicit = getattr(args, SOCKET_FLAGS[name][2:].replace("-", "_"))
    if explicit:
        return str(explicit)
    return str(pathlib.Path(args.uds_dir) / SOCKET_NAMES[name]) if args.uds_dir else None


def model_metrics_socket(args: argparse.Namespace) -> str | None:
    """The model's /metrics socket file: DIR/model-metrics.sock with --uds-dir unless --model-metrics-port is given."""
    if args.uds_dir and not args.model_metrics_port:
        return str(pathlib.Path(args.uds_dir) / MODEL_METRICS_SOCKET)
    return None


def all_sockets(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(path, the service's flag) of every socket file the stack will listen on."""
    found = [(path, flag) for name, flag in SOCKET_FLAGS.items() if (path := socket_path(args, name)) is not None]
    if (metrics := model_metrics_socket(args)) is not None:
        found.append((metrics, "--metrics-uds"))
    return found


def listener(args: argparse.Namespace, name: str) -> Listener:
    """Where `name` listens, from the launcher's flags (ports already chosen: run_stack.choose_free_ports)."""
    path = socket_path(args, name)
    port = getattr(args, PORT_FLAGS[name])
    if name == "http":
        if path:
            return Listener(path, ("--http-uds", path), path)
        url_host = f"[{args.host}]" if ":" in args.host else args.host
        return Listener(f"http://{url_host}:{port}" if port else "", ("--http-port", str(port)))
    if path:
        return Listener(f"unix:{path}", ("--uds", path), path)
    return Listener(f"{args.host}:{port}", ("--host", args.host, "--port", str(port)))


def port_unused(args: argparse.Namespace, dest: str) -> bool:
    """Whether the port flag `dest` is left unused: its listener is on a socket file instead."""
    named = next((name for name, port in PORT_FLAGS.items() if port == dest), None)
    return named is not None and socket_path(args, named) is not None


def prepare_directory(args: argparse.Namespace) -> bool:
    """Create --uds-dir (owner-only) when missing; whether this launcher created it."""
    if not args.uds_dir or os.path.isdir(args.uds_dir):
        return False
    os.makedirs(args.uds_dir, mode=0o700)
    return True


def unusable_sockets(args: argparse.Namespace) -> list[str]:
    """Why each socket path of the stack cannot be listened on now (empty: all free), as the service would say."""
    problems = []
    for path, flag in all_sockets(args):
        try:
            check_free(path, flag)
        except OSError as error:
            problems.append(str(error))
    return problems


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_left_sockets(args: argparse.Namespace, created_directory: bool) -> list[str]:
    """After the services stopped: remove the socket files none of them removed (one was killed), and the
    directory if this launcher created it and it is empty. The paths were checked free before the services
    started, so a file there nobody listens on is theirs. Returns the files removed."""
    removed = []
    for path, _ in all_sockets(args):
        if is_socket(path) and not listening(path, timeout=0.5):
            os.unlink(path)
            removed.append(path)
    remove_directory(args, created_directory)
    return removed


def remove_directory(args: argparse.Namespace, created: bool) -> None:
    """Remove --uds-dir if this launcher created it and it is empty again."""
    if created:
        try:
            os.rmdir(args.uds_dir)
        except OSError:
            pass  # something else was put there: keep it
