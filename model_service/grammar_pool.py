"""Worker processes for untrusted compiles: one request at a time each, a time limit per request, replaced
when they crash or overrun.

A structured-output constraint is compiled by a native library (llguidance) whose failure modes include a
segfault (a chain of ~3,000 grammar rules) and compiles that take many seconds. `WorkerPool.run` sends one
JSON request to an idle worker (grammar_worker.py) over its stdin and waits, at most `seconds`, for the
JSON reply line on its stdout: a worker that dies raises `WorkerCrashed`, one that overruns is killed and
raises `WorkerTimeout`, and either is started afresh for the next request. The service's own process, its
event loop and its decode thread never run the library on an unchecked constraint. A worker exits by itself
when its stdin closes, so none outlives the service (kill -9 included). No llguidance here.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

START_SECONDS = 120.0  # a worker loads the tokenizer's vocabulary before it says it is ready


class WorkerCrashed(Exception):
    """The worker died while it held the request (the message says how)."""


class WorkerTimeout(Exception):
    """The worker did not answer within the time limit (it was killed)."""


class PoolBusy(Exception):
    """More requests wait for a worker than the pool accepts."""


class WorkerUnavailable(RuntimeError):
    """A worker could not be started (the service's fault, not the request's)."""


class Worker:
    """One worker process and the bytes it has written that are not yet a whole line."""

    def __init__(self, command: Sequence[str]) -> None:
        self.proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buffer = b""
        self.ready = False

    def wait_ready(self) -> None:
        try:
            reply = self._line(time.monotonic() + START_SECONDS)
        except (WorkerCrashed, WorkerTimeout) as e:
            raise WorkerUnavailable(f"a constraint worker did not start ({e or 'no answer'})") from None
        if reply.get("ready") is not True:
            raise WorkerUnavailable(f"a constraint worker did not start: {reply}")
        self.ready = True

    def ask(self, request: dict[str, Any], seconds: float) -> dict[str, Any]:
        """Send one request; its reply, within `seconds` of the send."""
        if not self.ready:
            self.wait_ready()
        data = (json.dumps(request, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)
        except (BrokenPipeError, ConnectionResetError):
            raise WorkerCrashed(self._exit()) from None
        return self._line(time.monotonic() + seconds)

    def _line(self, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout()
            try:
                readable, _, _ = select.select([fd], [], [], remaining)
                if not readable:
                    continue
                chunk = os.read(fd, 1 << 16)
            except (OSError, ValueError):  # closed under us: the pool is closing
                raise WorkerCrashed("the service is shutting down") from None
            if not chunk:
                raise WorkerCrashed(self._exit())
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _exit(self) -> str:
        """How the process ended, in words (it has closed its output: it is exiting)."""
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
            return "it stopped answering"
        if code < 0:
            try:
                return f"it was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"it was killed by signal {-code}"
        return f"it exited with status {code}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class WorkerPool:
    """`size` workers started on demand; `run` is thread-safe and blocks until a worker has answered."""

    def __init__(self, command: Sequence[str], size: int, seconds: float, max_waiting: int) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self.command = list(command)
        self.seconds = seconds
        self.max_waiting = max_waiting
        self._idle: queue.Queue[Worker | None] = queue.Queue()
        for _ in range(size):
            self._idle.put(None)
        self._size = size
        self._lock = threading.Lock()
        self._waiting = 0
        self._closed = False
        self._all: set[Worker] = set()

    def start(self, wait: bool = False) -> None:
        """Start every worker now (they load while the caller goes on; the first request to each waits until it
        is ready, or with `wait` this call does)."""
        taken = [self._idle.get() for _ in range(self._size)]
        try:
            taken = [w if w is not None and w.alive() else self._spawn() for w in taken]
            for worker in taken if wait else ():
                worker.wait_ready()
        finally:
            for worker in taken:
                self._idle.put(worker)

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request's reply. WorkerCrashed / WorkerTimeout (the worker is replaced), PoolBusy,
        WorkerUnavailable."""
        with self._lock:
            if self._closed:
                raise WorkerCrashed("the service is shutting down")
            if self._waiting >= self.max_waiting:
                raise PoolBusy()
            self._waiting += 1
        try:
            worker = self._idle.get()
        finally:
            with self._lock:
                self._waiting -= 1
        try:
            if worker is None or not worker.alive():
                worker = self._spawn()
            return worker.ask(request, self.seconds)
        except (WorkerCrashed, WorkerTimeout, WorkerUnavailable) as e:
            log.warning("constraint worker replaced", extra={"detail": str(e) or "over its time limit"})
            self._discard(worker)
            worker = None
            raise
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """End every worker (those busy are killed; their callers get WorkerCrashed)."""
        with self._lock:
            self._closed = True
            workers = list(self._all)
        for worker in workers:
            self._discard(worker)

    def _spawn(self) -> Worker:
        worker = Worker(self.command)
        with self._lock:
            self._all.add(worker)
        return worker

    def _discard(self, worker: Worker | None) -> None:
        if worker is None:
            return
        worker.kill()
        with self._lock:
            self._all.discard(worker)
