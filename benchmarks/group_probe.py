"""Run `python -m MODULE ARGS` with the lockstep machinery timed: what benchmarks.group starts instead of
`python -m model_service` for each process of a group (`python benchmarks/group_probe.py model_service ...`).

It wraps functions that every checkout of the multi-process replica has (model_service/distributed:
lockstep.send/receive, LockstepEngine.step, Replica.run and the pending steps they return), so the same probe
times the code before and after a change. Each timed wait is a line `{"t": end, "kind": ..., "s": seconds}`
appended to $GROUP_PROBE_DIR/<process id>.jsonl (flushed by a thread every 50 ms):
  process 0: plan (sending a step's plan), engine (the whole Engine.step call the scheduler makes),
             results (the scheduler's wait in get() for a step's tokens);
  followers: plan (waiting for and reading a step's plan), engine (Replica.run: dispatching it),
             results (waiting for a dispatched step).
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

if sys.path and pathlib.Path(sys.path[0]).resolve() == pathlib.Path(__file__).resolve().parent:
    sys.path.pop(0)  # this folder's modules (engine.py, metrics.py, ...) must not shadow anything


class Records:
    """Timed waits, buffered and appended to a file by a daemon thread."""

    def __init__(self, path: pathlib.Path) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._file = open(path, "a")
        threading.Thread(target=self._flush_forever, name="group-probe", daemon=True).start()

    def add(self, kind: str, seconds: float) -> None:
        line = json.dumps({"t": time.monotonic(), "kind": kind, "s": seconds})
        with self._lock:
            self._lines.append(line)

    def _flush_forever(self) -> None:
        while True:
            time.sleep(0.05)
            with self._lock:
                lines, self._lines = self._lines, []
            if lines:
                self._file.write("\n".join(lines) + "\n")
                self._file.flush()


class TimedPending:
    """A dispatched step whose get() is timed."""

    def __init__(self, inner: Any, records: Records) -> None:
        self._inner, self._records = inner, records

    def get(self) -> Any:
        began = time.perf_counter()
        try:
            return self._inner.get()
        finally:
            self._records.add("results", time.perf_counter() - began)


def _timed(fn: Callable[..., Any], records: Records, kind: str, is_step: Callable[[Any, tuple[Any, ...]], bool],
           wrap: bool = False) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = fn(*args, **kwargs)
        if is_step(out, args):
            records.add(kind, time.perf_counter() - began)
            if wrap:
                return out[0], TimedPending(out[1], records)
        return out
    return timed


def install(process_id: int, records: Records) -> None:
    from model_service.distributed import lockstep, ops

    step = ops.Op.STEP
    if process_id == 0:
        lockstep.send = _timed(lockstep.send, records, "plan", lambda out, args: args[2].op == step)
        lockstep.LockstepEngine.step = _timed(lockstep.LockstepEngine.step, records, "engine",
                                              lambda out, args: True, wrap=True)
    else:
        lockstep.receive = _timed(lockstep.receive, records, "plan", lambda out, args: out.op == step)
        ops.Replica.run = _timed(ops.Replica.run, records, "engine", lambda out, args: args[1].op == step,
                                 wrap=True)


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    process_id = int(args[args.index("--process-id") + 1]) if "--process-id" in args else 0
    install(process_id, Records(pathlib.Path(os.environ["GROUP_PROBE_DIR"]) / f"{process_id}.jsonl"))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
