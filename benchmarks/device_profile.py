"""On the accelerator: where a step's device time goes: the engine's step traced with JAX's profiler, its ops summed per step and
grouped by the source file and line that emitted them; prints JSON.

    python -m benchmarks.device_profile --config ../shared/bench/medium.json --dtype bfloat16 --streams 1,8,64
        [--prompt-rows 8x32] [--mixed 64+2x32] [--moe auto] [--backend auto] [--steps 5] [--top 25] [--out PATH]

One process, one engine as the model service builds it (random weights; benchmarks/device_points.py's `build`):
compiled, every slot given a prompt, then per point (decode-N: N streams; prompts-PxL; mixed-N+PxL: N streams
decoding while P prompts of L tokens enter, in one step) a few untraced steps, the
median of `--runs` timed steps, the same dispatched back to back (decode: `pipelined_ms`, what a step costs the
serving loop, which plans the next step while the device computes one), and `--steps` steps under
`jax.profiler`. Each point reports the step's wall time, that wall time cut into the host's phases
(`host_phases_ms`: building the batch, dispatching it, the device finishing, the draws reaching the host),
the device's busy time a step (the ops' durations summed), the ops that took most of it (HLO name, ms a step,
count, the source line in the metadata of the compiled programs) and the same time by source file and by line.
On a TPU the ops are the device plane's "XLA Ops"; on a CPU (for testing) the host's XLA threads' events.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}", re.M)
_FIELD = re.compile(r'(\w+)=(?:"([^"]*)"|(\S+))')
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# Events that are the runtime's frames, not ops.
_NOT_OPS = ("ThunkExecutor", "SlinkyThreadPool", "end: ")


def _frames(text: str) -> dict[str, str]:
    """stack_frame_id -> 'file.py:line function' (the innermost frame) from the module's location tables."""
    tables: dict[str, dict[str, str]] = {t: {} for t in _TABLES}
    table = None
    for line in text.splitlines():
        if line in _TABLES:
            table = line
            continue
        m = re.match(r"(\d+) (.*)", line)
        if table is None or not m:
            if table is not None and line.startswith(("%", "ENTRY", "HloModule")):
                break
            continue
        tables[table][m.group(1)] = m.group(2)
    out = {}
    for fid, frame in tables["StackFrames"].items():
        loc = dict(re.findall(r"(\w+)=(\d+)", tables["FileLocations"].get(
            dict(re.findall(r"(\w+)=(\d+)", frame)).get("file_location_id", ""), "")))
        if loc:
            name = pathlib.Path(tables["FileNames"].get(loc["file_name_id"], "?").strip('"')).name
            out[fid] = f"{name}:{loc['line']} {tables['FunctionNames'].get(loc['function_name_id'], '').strip(chr(34))}"
    return out


def op_sources(hlo_texts: list[str]) -> dict[str, str]:
    """HLO instruction name -> 'file.py:line function' (or its op_name's last parts) from the programs' metadata."""
    out: dict[str, str] = {}
    for text in hlo_texts:
        frames = _frames(text)
        for name, meta in _INSTR.findall(text):
            fields = {k: a or b for k, a, b in _FIELD.findall(meta)}
            if fields.get("stack_frame_id") in frames:
                out.setdefault(name, frames[fields["stack_frame_id"]])
            elif "source_file" in fields:
                out.setdefault(name, f"{pathlib.Path(fields['source_file']).name}:{fields.get('source_line', '?')}")
            elif "op_name" in fields:
                out.setdefault(name, "/".join(fields["op_name"].split("/")[-2:]))
    return out


def _op_name(text: str) -> str:
    m = re.match(r"\s*%?([\w.\-]+)", text)
    return m.group(1) if m else text


def device_ops(xplane: str) -> tuple[str, list[tuple[str, int]]]:
    """(where, [(op name, ns)]) of the trace: a TPU/GPU device plane's "XLA Ops" line, else the CPU's XLA threads."""
    import jax

    data = jax.profiler.ProfileData.from_file(xplane)
    planes = list(data.planes)
    for plane in planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                if line.name == "XLA Ops":  # an event's name is its HLO text: "%fusion.12 = f32[...] fusion(...)"
                    return plane.name, [(_op_name(e.name), e.duration_ns) for e in line.events]
    events = []
    for plane in planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLA"):
                events += [(e.name, e.duration_ns) for e in line.events if not e.name.startswith(_NOT_OPS)]
    return "cpu threads", events


def summarise(events: list[tuple[str, int]], steps: int, sources: dict[str, str], top: int) -> dict[str, Any]:
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for name, ns in events:
        total[name] += ns
        count[name] += 1
    by_line: collections.Counter[str] = collections.Counter()
    by_file: collections.Counter[str] = collections.Counter()
    for name, ns in total.items():
        src = sources.get(name, sources.get(name.split(" ")[0], "?"))
        by_line[src] += ns
        by_file[src.split(":")[0]] += ns
    ms = lambda ns: round(ns / steps / 1e6, 4)  # noqa: E731
    return {"busy_ms": ms(sum(total.values())), "ops_per_step": round(sum(count.values()) / steps, 1),
            "top_ops": [{"op": k, "ms": ms(v), "count": count[k] / steps, "source": sources.get(k, "?")}
                        for k, v in total.most_common(top)],
            "by_file": {k: ms(v) for k, v in by_file.most_common()},
            "by_line": {k: ms(v) for k, v in by_line.most_common(top)}}


def host_phases(d: Any, make: Any, runs: int) -> dict[str, float]:
    """Where a step the host waits for goes, medians in ms: building its batch (`batch`), `Engine.step` until it
    returns (`dispatch`: arguments to the device, the program enqueued), the device finishing the new state
    (`device`), then the draws reaching the host (`fetch`)."""
    import jax

    took: dict[str, list[float]] = {"batch": [], "dispatch": [], "device": [], "fetch": []}
    for _ in range(runs):
        t0 = time.perf_counter()
        batches = make()
        t1 = time.perf_counter()
        pending = None
        for b in batches:
            d.state, pending = d.engine.step(d.state, b)
        t2 = time.perf_counter()
        jax.block_until_ready(d.state)
        t3 = time.perf_counter()
        if pending is not None:
            pending.get()
        t4 = time.perf_counter()
        for key, a, b in (("batch", t0, t1), ("dispatch", t1, t2), ("device", t2, t3), ("fetch", t3, t4)):
            took[key].append((b - a) * 1e3)
    return {k: round(statistics.median(v), 4) for k, v in took.items()}


def profile_point(d: Any, name: str, make: Any, runs: int, steps: int, sources: dict[str, str],
                  top: int, pipelined: bool = False) -> dict[str, Any]:
    import jax

    for _ in range(2):
        d.run(make())
    times = [d.run(make()) * 1e3 for _ in range(runs)]
    # Back to back, the host waiting once at the end: what the serving loop, which plans the next step while
    # the device computes this one, sees a step cost.
    back_to_back = d.run([b for _ in range(runs) for b in make()]) / runs * 1e3 if pipelined else None
    phases = host_phases(d, make, runs)
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(steps):
            d.run(make())
        jax.profiler.stop_trace()
        files = sorted(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True))
        where, events = device_ops(files[-1]) if files else ("none", [])
    return {"name": name, "step_ms": statistics.median(times), "step_ms_min": min(times),
            "pipelined_ms": back_to_back, "host_phases_ms": phases, "traced_steps": steps,
            "where": where, **summarise(events, steps, sources, top)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--streams", default="1,8,64")
    p.add_argument("--prompt-rows", default="", help="a prompts point, PROMPTSxTOKENS")
    p.add_argument("--decode-prompt", type=int, default=32)
    p.add_argument("--mixed", default="", help="a mixed point, STREAMS+PROMPTSxTOKENS (e.g. 64+2x32): STREAMS decode "
                                               "rows and the prompts' rows in one step")
    p.add_argument("--moe", default="auto")
    p.add_argument("--layers", default="auto")
    p.add_argument("--backend", default="auto")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="steps traced a point")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from benchmarks.device_points import Driver, build, device_facts, fill_slots

    streams = [int(s) for s in args.streams.split(",") if s]
    count, length = (int(x) for x in args.prompt_rows.split("x")) if args.prompt_rows else (0, 0)
    mixed_streams, mixed_prompts, mixed_length = (0, 0, 0)
    if args.mixed:
        head, tail = args.mixed.split("+")
        mixed_streams, (mixed_prompts, mixed_length) = int(head), (int(x) for x in tail.split("x"))
    begin = time.perf_counter()
    engine, _ = build(args.config, args.dtype, max(streams + [count, mixed_streams + mixed_prompts, 1]), 0,
                      args.backend, args.moe, args.layers)
    built = time.perf_counter() - begin
    compiled = engine.compile()
    texts = [c.as_text() for c in getattr(engine, "_compiled", {}).values()]
    sources = op_sources(texts)
    out: dict[str, Any] = {"config": args.config, "dtype": args.dtype, "moe": args.moe, "built_s": round(built, 2),
                           "compile_s": {k: round(v, 2) for k, v in compiled.items()},
                           "backend": getattr(getattr(engine.model, "backend", None), "moe", None), "points": []}
    d = Driver(engine, 0)
    if count:
        prompts = {s: d.tokens(length) for s in range(count)}
        out["points"].append(profile_point(d, f"prompts-{count}x{length}", lambda: d.prompt_batches(prompts),
                                           args.runs, args.steps, sources, args.top))
    fill_slots(d, args.decode_prompt)
    for n in streams:
        out["points"].append(profile_point(d, f"decode-{n}", lambda n=n: [d.decode_batch(list(range(n)))],
                                           args.runs, args.steps, sources, args.top, pipelined=True))
        print(json.dumps({k: out["points"][-1][k] for k in ("name", "step_ms", "pipelined_ms", "busy_ms")}),
              file=sys.stderr, flush=True)
    if args.mixed:
        decoding = list(range(mixed_streams))
        entering = {mixed_streams + i: d.tokens(mixed_length) for i in range(mixed_prompts)}
        out["points"].append(profile_point(d, f"mixed-{args.mixed}", lambda: [d.mixed_batch(decoding, entering)],
                                           args.runs, args.steps, sources, args.top, pipelined=True))
        print(json.dumps({k: out["points"][-1][k] for k in ("name", "step_ms", "pipelined_ms", "busy_ms")}),
              file=sys.stderr, flush=True)
    out["device"] = device_facts()
    text = json.dumps(out, indent=1)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
