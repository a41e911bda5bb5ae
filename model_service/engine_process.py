"""The gRPC process's side of `--engine-process`: the Scheduler's surface, served by an engine process.

`EngineProcess` spawns engine_core.run (multiprocessing's spawn context) and stands where a Scheduler stands for
the servicer, the watchdog and the server: `validate` (here, with the limits the child sent when it was ready),
`guidance.compile_async` (constraints compile in the child: a bad one ends its request with INVALID_ARGUMENT),
`submit` (a handle whose `cancel()` reaches the child), `heartbeat`, `fail_pending`, `close` and `stop`. One
reader thread receives the child's batches: each emission goes to its request's `emit` (the servicer's
EmissionSink, whose relay wakes the event loop once for the batch) and each metrics call is replayed on the
service's Metrics. This process never touches JAX's devices; the platform and device count come in `ready`.

When the child exits unasked (killed, crashed, out of memory), every open request ends with UNAVAILABLE naming
its exit code and `on_exit` tells the server, which exits non-zero as for a broken group (an orchestrator
restarts it). A child that fails to start makes `wait_ready` raise with the child's own message.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from model_service import engine_core
from model_service.engine_api import EngineLike
from model_service.engine_core import Ready, Settings
from model_service.distributed.lockstep import GroupBroken
from model_service.loading import ServerConfig
from model_service.loop_state import Heartbeat, SchedulerMetrics
from model_service.requests import Emission, EmitFn, ErrorKind, GenerationRequest, SchedulerError
from model_service.validation import validate

log = logging.getLogger(__name__)

STOP_SECONDS = 30.0  # a stopping child gets this long to end its decode loop and say so, then it is killed
JAX_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                "jax_persistent_cache_min_entry_size_bytes")


def exit_description(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    return f"killed by signal {-code}, exit code {code}" if code < 0 else f"exit code {code}"


class RemoteHandle:
    """A submitted request's handle: `cancel()` (any thread) asks the child to free its slot at the next step."""

    def __init__(self, owner: EngineProcess, key: int, request: GenerationRequest, emit: EmitFn) -> None:
        self.owner = owner
        self.key = key
        self.request = request
        self._emit = emit
        self._open = request.n
        self.done = False

    def cancel(self) -> None:
        if not self.done:
            self.owner.cancel(self)

    def take(self, emission: Emission) -> bool:
        """Hand over one emission (reader thread); True when it ended the request."""
        if emission.finish_reason is not None:
            self._open -= 1
        if emission.error is not None or self._open <= 0:
            self.done = True
        try:
            self._emit(emission)
        except Exception:  # a broken consumer must not take the reader thread down
            log.exception("emit failed", extra={"request_id": self.request.request_id})
        return self.done


class RemoteGuidance:
    """Guidance's surface in this process: constraints compile in the engine process (at its submit)."""

    grammars = None  # the compiler and its workers live in the child

    def __init__(self, structured: bool) -> None:
        self.structured = structured

    async def compile_async(self, request: GenerationRequest) -> None:
        c = request.constraint
        if c is not None and not self.structured:
            raise SchedulerError(ErrorKind.INVALID_ARGUMENT, f"{c.field}: this model service was started without "
                                 "structured output (model_service --tokenizer, the model's SentencePiece file)")
        return None


class EngineProcess:
    """The engine process, seen as a Scheduler. `start()` on the thread that lives as long as the service (the
    child dies with that thread: PR_SET_PDEATHSIG), then `wait_ready()` (blocking)."""

    engine = None  # the Engine lives in the child (server.stop_scheduler closes what has a `close`)

    def __init__(self, config: ServerConfig, metrics: SchedulerMetrics,
                 factory: Callable[[], EngineLike] | None = None,
                 on_exit: Callable[[str], None] = lambda reason: None,
                 on_broken: Callable[[str], None] = lambda reason: None) -> None:
        self.config = config
        self.metrics = metrics
        self.factory = factory  # importable by name (spawn pickles it); None: the child builds what config says
        self.on_exit = on_exit
        self.on_broken = on_broken
        self.guidance = RemoteGuidance(False)
        self.limits: Ready | None = None
        self.exited: str | None = None  # why the child is gone, once it is
        self._context = multiprocessing.get_context("spawn")
        self._conn: Any = None
        self.process: Any = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._open: dict[int, RemoteHandle] = {}
        self._next_key = 0
        self._accepting = False
        self._stopping = False
        self._beat = Heartbeat(0, time.monotonic(), 0, True)
        self._stats = {"active": 0, "free": 0, "queued": 0}
        self._reader: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        ours, theirs = self._context.Pipe(duplex=True)
        self.process = self._context.Process(target=engine_core.run, name="model-engine", daemon=True,
                                             args=(theirs, self.config, self.factory, self._settings()))
        try:
            self.process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"the engine process cannot be given this engine factory ({e}): pass one importable "
                             "by name (a module-level function), or none to build the engine the config names") from e
        # Before multiprocessing's exit handler SIGTERMs (ignored there) and joins it: a child not stopped is killed.
        multiprocessing.util.Finalize(None, self._kill_at_exit, exitpriority=10)
        theirs.close()  # the child's end lives in the child only: its exit closes the pipe
        self._conn = ours

    def _kill_at_exit(self) -> None:
        self._stopping = True  # not a failure to report
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)

    @staticmethod
    def _settings() -> Settings:
        import jax  # its settings only: this process never starts a backend

        cache = jax.config.jax_compilation_cache_dir
        values = tuple((name, getattr(jax.config, name)) for name in JAX_SETTINGS) if cache else ()
        root = logging.getLogger()
        text = not root.handlers or type(root.handlers[0].formatter).__name__ != "JsonFormatter"
        return Settings(values, os.getpid(), logging.getLevelName(root.level).lower(), "text" if text else "json")

    def wait_ready(self) -> Ready:
        """Block until the child serves; RuntimeError with the child's message when it failed to start (GroupBroken
        when its group broke)."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self.process.join(5.0)
                raise RuntimeError(f"the engine process exited while starting "
                                   f"({exit_description(self.process.exitcode)}); see its log above") from None
            if message[0] == "ready":
                break
            if message[0] == "broken":
                raise GroupBroken(message[1])
            if message[0] == "error":
                self.process.join(5.0)
                if message[2]:
                    raise GroupBroken(message[1])
                raise RuntimeError(f"the engine process failed to start: {message[1]}")
        ready: Ready = message[1]
        self.limits = ready
        self.guidance = RemoteGuidance(ready.structured)
        self._stats["free"] = ready.slots
        self._accepting = True
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        return ready

    def close(self) -> None:
        """Stop admitting new requests (draining); queued and running ones continue."""
        self._accepting = False
        self._send(("close",))

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the child (its open requests fail with UNAVAILABLE) and wait for it; kill it if it does not stop."""
        self._accepting = False
        self._stopping = True
        if self.process is None:
            return
        self._send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout)
        self.process.join(timeout if self._reader is None else 5.0)
        if self.process.is_alive():
            log.warning("the engine process did not stop: killing it")
            self.process.kill()
            self.process.join(5.0)
        self._fail_open(SchedulerError(ErrorKind.UNAVAILABLE, "the model service is shutting down; retry"))

    # ---- the Scheduler's surface ------------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        """Raise INVALID_ARGUMENT for anything the engine could not serve as asked (validation.py)."""
        if self.limits is None:
            raise SchedulerError(ErrorKind.UNAVAILABLE, "the model is still loading or compiling; retry shortly")
        validate(request, self.limits)

    def submit(self, request: GenerationRequest, emit: EmitFn, grammar: Any = None) -> RemoteHandle:
        """Send the request to the engine process; its emissions come back through `emit` (reader thread)."""
        if self.exited is not None:
            raise SchedulerError(ErrorKind.UNAVAILABLE, self.exited)
        if not self._accepting:
            raise SchedulerError(ErrorKind.UNAVAILABLE, "the model service is not accepting requests "
                                 "(starting up or draining); retry on another replica or later")
        with self._lock:
            key, self._next_key = self._next_key, self._next_key + 1
            handle = RemoteHandle(self, key, request, emit)
            self._open[key] = handle
        if not self._send(("submit", key, request)):
            self._finish(key, SchedulerError(ErrorKind.UNAVAILABLE, self.exited or "the engine process is gone"))
        return handle

    def cancel(self, handle: RemoteHandle) -> None:
        self._send(("cancel", handle.key))

    def heartbeat(self) -> Heartbeat:
        beat = self._beat
        if self.exited is not None or self.process is None or not self.process.is_alive():
            return Heartbeat(beat.steps, beat.at, beat.pending, False)
        return beat

    def fail_pending(self, error: SchedulerError) -> int:
        """End every open request with `error` now; the child frees their slots when its loop comes back."""
        count = self._fail_open(error)
        self._send(("fail", error.kind, error.message))
        return count

    def stats(self) -> dict[str, int]:
        """Busy slots, free slots and queued requests as the child last reported them."""
        return dict(self._stats)

    # ---- the pipe -----------------------------------------------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> bool:
        """False when the child is gone (its reader thread reports that)."""
        if self._conn is None:
            return False
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (OSError, EOFError, ValueError):
            return False

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "batch":
                    # the child's counts first: a client that hears of a token may ask for them at once
                    self._beat, self._stats = message[2], message[3]
                    self._take_batch(message[1])
                elif kind == "broken":
                    self.on_broken(message[1])
                elif kind == "stopped":
                    return
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("the engine reader failed")
            self.process.kill()
        if not self._stopping:
            self._child_exited()

    def _take_batch(self, items: list[tuple[Any, ...]]) -> None:
        for item in items:
            if item[0] == "emit":
                _, key, emission, error = item
                if error is not None:
                    emission = Emission(emission.tokens, emission.completion_tokens, emission.prompt_tokens,
                                        emission.finish_reason, SchedulerError(*error), emission.timings,
                                        emission.index, emission.prompt)
                handle = self._open.get(key)
                if handle is not None and handle.take(emission):
                    with self._lock:
                        self._open.pop(key, None)
            else:
                _, name, args = item
                try:
                    getattr(self.metrics, name)(*args)
                except Exception:
                    log.exception("metrics update failed", extra={"metric": name})

    def _child_exited(self) -> None:
        self.process.join(5.0)
        self.exited = (f"the model service's engine process exited ({exit_description(self.process.exitcode)}); "
                       "retry, another replica may serve the request")
        self._accepting = False
        log.error("the engine process exited", extra={"exit_code": self.process.exitcode})
        self._fail_open(SchedulerError(ErrorKind.UNAVAILABLE, self.exited))
        self.on_exit(self.exited)

    def _finish(self, key: int, error: SchedulerError) -> None:
        with self._lock:
            handle = self._open.pop(key, None)
        if handle is not None:
            handle.take(Emission((), 0, len(handle.request.prompt), error=error))

    def _fail_open(self, error: SchedulerError) -> int:
        with self._lock:
            handles, self._open = list(self._open.values()), {}
        for handle in handles:
            handle.take(Emission((), 0, len(handle.request.prompt), error=error))
        return len(handles)
