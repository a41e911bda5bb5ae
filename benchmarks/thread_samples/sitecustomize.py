"""Where each thread of a service spends its time, sampled from inside the process (a Python-level py-spy).

Put this directory first on PYTHONPATH and set GROK_THREAD_SAMPLES=DIR: every service started from that
environment (`python -m model_service`, `gateway`, `tokenizer_service`; GROK_THREAD_SAMPLES_MODULES narrows the
list) samples every thread's Python stack each GROK_THREAD_SAMPLES_INTERVAL seconds (default 0.002) and writes
DIR/<module>-<pid>.json at exit and every 10 s (the model service's multiprocessing children, its engine process,
as spawn-<pid>.json; other processes' children, such as a benchmark's client workers, are not sampled): per thread, its CPU seconds, its samples, the stacks seen most
often and the innermost lines seen most often. A thread blocked in C (a device wait, the GIL, epoll) shows the
Python line that called it. Used on hosts without a profiler (the TPU host: `benchmarks.layers` passes its
environment to the services it starts); costs one GIL hand-over per interval.
"""

import os
import sys


def _start(out_dir: str, module: str) -> None:
    import atexit
    import collections
    import json
    import threading
    import time

    interval = float(os.environ.get("GROK_THREAD_SAMPLES_INTERVAL", "0.002"))
    stacks: collections.Counter = collections.Counter()
    lines: collections.Counter = collections.Counter()
    per_thread: collections.Counter = collections.Counter()
    native: dict[str, int] = {}
    path = os.path.join(out_dir, f"{module}-{os.getpid()}.json")

    def where(frame) -> str:
        code = frame.f_code
        return f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}"

    def dump() -> None:
        threads = {}
        for name, count in per_thread.items():
            cpu = None
            tid = native.get(name)
            if tid is not None:
                try:
                    with open(f"/proc/self/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                except (OSError, IndexError, ValueError):
                    pass
            top = [[n, s] for (t, s), n in stacks.most_common() if t == name][:25]
            inner = [[n, s] for (t, s), n in lines.most_common() if t == name][:25]
            threads[name] = {"cpu_s": cpu, "samples": count, "stacks": top, "lines": inner}
        report = {"pid": os.getpid(), "argv": sys.orig_argv, "interval_s": interval, "threads": threads}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, path)

    def sample() -> None:
        last = time.monotonic()
        while True:
            time.sleep(interval)
            names = {t.ident: (t.name, t.native_id) for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():  # the sampler itself
                    continue
                name, tid = names.get(ident, (str(ident), None))
                if tid is not None:
                    native[name] = tid
                per_thread[name] += 1
                lines[(name, where(frame))] += 1
            if time.monotonic() - last > 10:
                last = time.monotonic()
                dump()

    import cProfile
    profile = cProfile.Profile()  # the main thread's calls (the services' event loop), deterministic

    def dump_all() -> None:
        profile.disable()
        profile.dump_stats(path[:-5] + ".prof")
        dump()

    threading.Thread(target=sample, name="thread-samples", daemon=True).start()
    profile.enable()
    atexit.register(dump_all)


def _module() -> str | None:
    argv = list(getattr(sys, "orig_argv", []))
    wanted = os.environ.get("GROK_THREAD_SAMPLES_MODULES", "model_service,gateway,tokenizer_service,spawn").split(",")
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] in wanted:
            return argv[i + 1]
        if arg == "-c" and "spawn_main" in argv[i + 1] and "spawn" in wanted and (
                os.environ.get("GROK_THREAD_SAMPLES_PARENT") == "model_service"):
            return "spawn"  # the model service's multiprocessing child: its engine process (--engine-process)
    return None


if os.environ.get("GROK_THREAD_SAMPLES"):
    _name = _module()
    if _name is not None:
        if _name == "model_service":
            os.environ["GROK_THREAD_SAMPLES_PARENT"] = _name  # its spawned children (the engine process) sample too
        os.makedirs(os.environ["GROK_THREAD_SAMPLES"], exist_ok=True)
        _start(os.environ["GROK_THREAD_SAMPLES"], _name)
