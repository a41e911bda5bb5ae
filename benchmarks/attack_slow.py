"""A bounded slowloris against the gateway's HTTP port (loopback only, a fixed number of clients, a fixed
time, stops by itself): clients that send their headers a byte per second must be disconnected by the
server's header deadline (gateway/http/slow_clients.py), and /health must answer meanwhile."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from typing import Any

CLIENTS = 30
LIMIT_SECONDS = 25.0  # the attack gives up after this; the server's header deadline is 10 s


def _client(port: int, outcomes: list[str], lock: threading.Lock) -> None:
    stop = time.monotonic() + LIMIT_SECONDS
    outcome = "held open"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: attack\r\n")
            s.settimeout(1.0)
            while time.monotonic() < stop:
                try:
                    answer = s.recv(4096)
                except socket.timeout:
                    s.sendall(b"x")  # one more byte of a header that never ends
                    continue
                outcome = "408" if answer.startswith(b"HTTP/1.1 408") else "closed" if not answer else "answered"
                break
    except OSError:
        outcome = "closed"
    with lock:
        outcomes.append(outcome)


def slowloris(port: int) -> dict[str, Any]:
    """Run the attack; the harness's result row for it."""
    outcomes: list[str] = []
    lock = threading.Lock()
    began = time.monotonic()
    threads = [threading.Thread(target=_client, args=(port, outcomes, lock), daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
            health = reply.status
    except OSError as error:
        health = str(error)
    for t in threads:
        t.join(LIMIT_SECONDS + 10)
    held = outcomes.count("held open")
    problems = ([f"{held} of {CLIENTS} slow clients still connected after {LIMIT_SECONDS} s"] if held else []) + (
        [f"/health during the attack: {health}"] if health != 200 else [])
    return {"case": f"http-slowloris-{CLIENTS}-clients", "service": "gateway-http", "expected": "all cut off",
            "got": f"{outcomes.count('408')} x 408, {outcomes.count('closed')} closed, {held} held; /health {health}",
            "passed": not problems, "problems": problems, "seconds": round(time.monotonic() - began, 1)}
