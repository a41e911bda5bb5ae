"""The engine process (`--engine-process`): the Engine and the Scheduler's decode loop, away from the gRPC loop.

In one interpreter the grpc.aio event loop and the decode thread take turns on the GIL, and every millisecond the
loop holds it delays the device's next dispatch. With `--engine-process` the gRPC process (engine_process.py) spawns
this one (multiprocessing's spawn context: JAX and grpc are not fork-safe), which loads the weights, builds the
Engine, the structured-output compiler and the Scheduler, and runs the decode loop. Parent and child share one
duplex pipe (multiprocessing.connection); the messages are plain tuples:

    parent -> child   ("submit", key, GenerationRequest)  ("cancel", key)  ("close",)  ("fail", kind, message)
                      ("stop",)
    child -> parent   ("ready", Ready)  ("error", message, broken)  ("stopped",)
                      ("batch", items, Heartbeat, stats)

A batch carries everything the decode loop reported since the last one, in order: ("emit", key, Emission,
error) items and ("metric", name, args) items (the SchedulerMetrics calls, replayed on the parent's Metrics;
gauges only their last value). The decode thread only appends to the outbox; one sender thread sends it, at
least every HEARTBEAT_SECONDS (with the loop's heartbeat, for the parent's watchdog). A SchedulerError travels
as (kind, message): its pickled form would lose the kind.

The child ends when the parent says stop, when the pipe closes, or when the parent dies (PR_SET_PDEATHSIG). It
ignores SIGINT and SIGTERM: a signal sent to the whole process group (Ctrl-C, `kill -- -PGID`, systemd's stop)
reaches the parent too, which drains its streams and then stops this one (or, exiting, kills it).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from model_service.engine_api import EngineLike
from model_service.loading import ServerConfig
from model_service.loop_state import SchedulerMetrics
from model_service.requests import Emission, ErrorKind, GenerationRequest, RequestHandle, SchedulerError
from model_service.structured import GrammarCompiler, Vocabulary

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.25  # a batch goes at least this often, so the parent's watchdog sees the loop
GAUGES = frozenset({"set_active", "set_queued", "observe_kv"})  # only the latest value of a batch matters


@dataclass(frozen=True)
class Ready:
    """What the parent needs from the child once it serves: validation's limits (validation.EngineLimits), what
    GetInfo reports of the devices, and whether structured output is on."""

    slots: int
    sequence_len: int
    vocab_size: int
    pad_id: int
    num_blocks: int
    block_size: int
    platform: str
    device_count: int
    structured: bool


@dataclass(frozen=True)
class Settings:
    """The parent's process settings the child repeats: jax.config values (a spawned interpreter starts with
    defaults), the parent's pid (to die with it) and its log format."""

    jax: tuple[tuple[str, Any], ...]
    parent_pid: int
    log_level: str
    log_format: str


def error_of(error: SchedulerError | None) -> tuple[ErrorKind, str] | None:
    return None if error is None else (error.kind, error.message)


def grammar_compiler(config: ServerConfig, vocab_size: int) -> GrammarCompiler | None:
    """The structured-output compiler over --tokenizer's vocabulary (None without one: constrained requests are
    then refused with INVALID_ARGUMENT); its worker processes start loading the vocabulary now."""
    if config.tokenizer is None:
        return None
    grammars = GrammarCompiler(Vocabulary(config.tokenizer), vocab_size)
    grammars.start()
    return grammars


class Outbox(SchedulerMetrics):
    """What the decode loop reports, queued for the sender thread (the loop only appends); also the Scheduler's
    metrics, which it records as calls to replay."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[Any, ...]] = []
        self._gauges: dict[str, tuple[Any, ...]] = {}
        self.wake = threading.Event()

    def put(self, item: tuple[Any, ...]) -> None:
        with self._lock:
            self._items.append(item)
        self.wake.set()

    def take(self) -> list[tuple[Any, ...]]:
        with self._lock:
            items, self._items = self._items, []
            gauges, self._gauges = self._gauges, {}
            self.wake.clear()
        return items + [("metric", name, args) for name, args in gauges.items()]

    def _call(self, name: str, *args: Any) -> None:
        if name in GAUGES:
            with self._lock:
                self._gauges[name] = args
            return
        self.put(("metric", name, args))

    def set_active(self, n: int) -> None: self._call("set_active", n)
    def set_queued(self, n: int) -> None: self._call("set_queued", n)
    def observe_prefill(self, seconds: float) -> None: self._call("observe_prefill", seconds)
    def observe_step(self, seconds: float, kind: str = "decode", period: float | None = None) -> None:
        self._call("observe_step", seconds, kind, period)
    def add_tokens(self, n: int) -> None: self._call("add_tokens", n)
    def finished(self, reason: Any) -> None: self._call("finished", reason)
    def observe_kv(self, usage: Any) -> None: self._call("observe_kv", usage)
    def speculated(self, drafted: int, accepted: int) -> None: self._call("speculated", drafted, accepted)
    def preempted(self) -> None: self._call("preempted")
    def observe_reclaim(self, reason: str, seconds: float, steps: int | None) -> None:
        self._call("observe_reclaim", reason, seconds, steps)


class Core:
    """The child's side: a started Scheduler, its requests by the parent's keys, and the pipe."""

    def __init__(self, conn: Connection, scheduler: Any, outbox: Outbox, send_lock: threading.Lock) -> None:
        self.conn = conn
        self.scheduler = scheduler
        self.outbox = outbox
        self._send_lock = send_lock  # the batches, and a group's broken notice from another thread
        self._lock = threading.Lock()
        self._handles: dict[int, RequestHandle] = {}
        self._cancelled: set[int] = set()  # cancelled while their constraint compiled
        self._compiles = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="constraint")
        self._done = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="engine-sender", daemon=True)

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(message)

    def _emitter(self, key: int) -> Callable[[Emission], None]:
        def emit(emission: Emission) -> None:
            error = error_of(emission.error)
            if error is not None:
                emission = Emission(emission.tokens, emission.completion_tokens, emission.prompt_tokens,
                                    emission.finish_reason, None, emission.timings, emission.index, emission.prompt)
            self.outbox.put(("emit", key, emission, error))
            handle = self._handles.get(key)
            if handle is not None and handle.done.is_set():
                with self._lock:
                    self._handles.pop(key, None)
        return emit

    def _flush(self) -> None:
        items = self.outbox.take()
        beat = self.scheduler.heartbeat()
        self.send(("batch", items, beat, self.scheduler.stats()))

    def _send_loop(self) -> None:
        try:
            while not self._done.is_set():
                self.outbox.wake.wait(HEARTBEAT_SECONDS)
                self._flush()
        except (OSError, EOFError, ValueError):  # the parent is gone: the receive loop ends too
            pass
        except Exception:
            log.exception("the engine process's sender failed")
            os._exit(1)  # the parent sees the pipe close and fails the service (a silent sender would hang it)

    def submit(self, key: int, request: GenerationRequest) -> None:
        """Queue the request; a constrained one compiles on a constraint thread first (never on this one)."""
        if request.constraint is not None:
            self._compiles.submit(self._submit, key, request)
        else:
            self._submit(key, request)

    def _submit(self, key: int, request: GenerationRequest) -> None:
        emit = self._emitter(key)
        try:
            handle = self.scheduler.submit(request, emit)
        except SchedulerError as e:
            emit(Emission((), 0, len(request.prompt), error=e))
            return
        except Exception:
            log.exception("submit failed", extra={"request_id": request.request_id})
            emit(Emission((), 0, len(request.prompt), error=SchedulerError(
                ErrorKind.INTERNAL, f"the request could not be queued (request {request.request_id})")))
            return
        with self._lock:
            cancelled = key in self._cancelled
            self._cancelled.discard(key)
            if not cancelled and not handle.done.is_set():
                self._handles[key] = handle
        if cancelled:
            handle.cancel()

    def cancel(self, key: int) -> None:
        with self._lock:
            handle = self._handles.pop(key, None)
            if handle is None:
                self._cancelled.add(key)  # its submit may still be compiling a constraint
        if handle is not None:
            handle.cancel()

    def serve(self) -> None:
        """Answer the parent's messages until it says stop or goes away; then stop the loop."""
        self._sender.start()
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    log.warning("the model service's gRPC process went away: the engine process stops")
                    return
                kind = message[0]
                if kind == "submit":
                    self.submit(message[1], message[2])
                elif kind == "cancel":
                    self.cancel(message[1])
                elif kind == "close":
                    self.scheduler.close()
                elif kind == "fail":
                    self.scheduler.fail_pending(SchedulerError(message[1], message[2]))
                elif kind == "stop":
                    return
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        self.scheduler.stop()  # requests still open fail with UNAVAILABLE, which is sent below
        self._done.set()
        self._sender.join(HEARTBEAT_SECONDS * 4)
        self._compiles.shutdown(wait=False, cancel_futures=True)
        try:
            self._flush()
            self.send(("stopped",))
        except (OSError, EOFError, ValueError):
            pass
        if self.scheduler.guidance.grammars is not None:
            self.scheduler.guidance.grammars.close()
        close = getattr(self.scheduler.engine, "close", None)  # a LockstepEngine shuts its followers down
        if close is not None:
            close()


def _prepare(settings: Settings) -> None:
    """This process's settings before JAX starts: die with the parent, its log format, the host allocator and the
    parent's jax.config; Ctrl-C on a terminal reaches the parent, which drains and then stops this process."""
    from serving_common import logs
    from serving_common.with_parent import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != settings.parent_pid:  # the parent died before the signal was armed
        sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a signal to the whole group: the parent drains, then stops us
    logs.configure("model", settings.log_level, settings.log_format)
    from model_service.host_memory import accelerator_expected, keep_freed_memory

    if not accelerator_expected():
        keep_freed_memory()
    import jax

    for name, value in settings.jax:
        jax.config.update(name, value)


def _build(conn: Connection, config: ServerConfig, factory: Callable[[], EngineLike] | None) -> Core:
    """Load, compile and start everything; the caller reports a failure to the parent."""
    import jax

    from model_service.loading import build_engine, resolve
    from model_service.scheduler import Scheduler

    if config.distributed is not None:  # __main__ refuses the two together (a group keeps its engine in process 0)
        raise ValueError("--engine-process serves a single-process replica, not one of --num-processes > 1")
    from model_service.placement import check_service

    check_service(config)
    send_lock = threading.Lock()
    engine = factory() if factory is not None else build_engine(config, resolve(config))
    grammars = grammar_compiler(config, engine.vocab_size)
    outbox = Outbox()
    scheduler = Scheduler(engine, config.max_queue, outbox, config.prefill_tokens, grammars, config.prefix_caching,
                          config.speculative, config.decode_slowdown)
    scheduler.start()
    core = Core(conn, scheduler, outbox, send_lock)
    devices = jax.devices()[:config.mesh.size]
    ready = Ready(engine.slots, engine.sequence_len, engine.vocab_size, engine.pad_id, engine.num_blocks,
                  engine.block_size, devices[0].platform if devices else "", len(devices), grammars is not None)
    core.send(("ready", ready))
    return core


def run(conn: Connection, config: ServerConfig, factory: Callable[[], EngineLike] | None, settings: Settings) -> None:
    """The engine process's entry point (multiprocessing's target)."""
    _prepare(settings)
    try:
        core = _build(conn, config, factory)
    except BaseException as e:
        from model_service.distributed.lockstep import GroupBroken

        log.exception("the engine process failed to start")
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", isinstance(e, GroupBroken)))
        except (OSError, EOFError, ValueError):
            pass
        sys.exit(1)
    core.serve()
