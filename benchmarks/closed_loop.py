"""The in-process engine under closed-loop clients that are not instantaneous: what the scheduling policy makes
of requests that arrive apart, as they do through the services.

    python -m benchmarks.closed_loop --stack medium --concurrency 64 --dead-ms 0,10 --slowdown 1.8,100

`benchmarks.layers` measures its in-process arm with clients that send their next request in the same instant
the last one ended: with requests of one length they stay in lockstep, every round's prompts enter in one step
and the rest of the round only decodes. Through the services each client's next request arrives some
milliseconds later (`ttft_outside` in layers' runs), each at its own time, and the rounds dissolve: every step
then carries a few prompts beside the decoding streams. Here the same Scheduler and Engine as the model service's
(built as layers builds them, once) serve `--concurrency` closed-loop clients that wait after each request ends
before sending the next one (drawn from [0, 2 * `--dead-ms`] each time), for each scheduling policy given:
`--slowdown` (the pacing factor `--decode-slowdown`: prompts get rows so that a mixed step takes about that many
decode steps; a large value leaves only the step's rows and the row buckets to bound them) and `--prefill-rows` (a
fixed prompt budget per step, `--prefill-tokens`). Each point reports output tokens/s, TTFT with its queued part,
TPOT, how the loop stepped (steps by kind, their loop milliseconds, tokens a step) and the pacing's prompt budget,
and its ratio to the first policy at the smallest dead time.

`--step-probe` first times single steps on the same engine, the host waiting for each (median ms): decoding
streams alone, and beside prompts that enter (their slots started in the step) or continue (no start), and the
starting of slots alone: what a mixed step costs over a decode step, and how much of it is the slots' start.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time
from typing import Any

from benchmarks import metrics, results
from benchmarks.layers import InProcessSender, in_process_engine, registry_steps, step_shape
from benchmarks.loadgen import LoadPoint, run_point, warm_up
from benchmarks.stack import preset
from benchmarks.workload import PromptCutter, WorkloadSpec, build


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


class DeadTimeSender:
    """A sender whose client waits after each request ends before its next one: `dead` seconds on average, drawn
    uniformly from [0, 2 * dead] (a fixed wait would keep clients that started together in lockstep)."""

    def __init__(self, inner: Any, dead: float, seed: int = 0) -> None:
        self.inner, self.dead = inner, dead
        self.rng = random.Random(seed)

    async def __call__(self, request: Any) -> Any:
        result = await self.inner(request)
        if self.dead > 0:
            await asyncio.sleep(self.rng.uniform(0.0, 2 * self.dead))
        return result


async def sample_budget(scheduler: Any, into: list[float], every: float = 0.005) -> None:
    """The pacing's prompt budget (row-equivalents a step may take while streams decode), sampled until cancelled."""
    while True:
        into.append(scheduler.pacing.budget())
        await asyncio.sleep(every)


def step_probe(engine: Any, streams: int, prompts: tuple[int, ...], length: int, runs: int) -> list[dict[str, Any]]:
    """Single steps timed with the host waiting for each: `streams` decoding alone, then beside P prompts of
    `length` tokens (P in `prompts`) whose slots start in the step, and the same rows without the starts; and
    the starts alone (Engine._start, what a step with new slots dispatches first)."""
    import jax

    from benchmarks.device_points import Driver, fill_slots

    d = Driver(engine, 0)
    fill_slots(d, length)
    out = []

    def timed(name: str, make: Any, **extra: Any) -> None:
        for _ in range(2):
            d.run(make())
        times = [d.run(make()) * 1e3 for _ in range(runs)]
        out.append({"name": name, "ms": statistics.median(times), "ms_min": min(times), **extra})
        print(f"step probe {name}: {statistics.median(times):.2f} ms", file=sys.stderr, flush=True)

    decoding = list(range(streams))
    timed(f"decode-{streams}", lambda: [d.decode_batch(decoding)], rows=streams, bucket=engine.rows_for(streams))
    for more in sorted({min(engine.slots, 2 * streams), engine.slots} - {streams}):
        timed(f"decode-{more}", lambda: [d.decode_batch(list(range(more)))], rows=more,  # noqa: B023
              bucket=engine.rows_for(more))
    if streams > length:  # a prompt's rows in the decode step's own bucket: what prompt rows cost, no bucket change
        fewer, entering = list(range(streams - length)), {streams: d.tokens(length)}
        timed(f"mixed-{streams - length}+1x{length}-no-start",
              lambda: [dataclasses.replace(d.mixed_batch(fewer, entering), starts=())], rows=streams,
              bucket=engine.rows_for(streams))
    for p in prompts:
        entering = {streams + i: d.tokens(length) for i in range(p)}
        rows = streams + p * length
        if rows > engine.max_rows:
            print(f"step probe: {rows} rows are over the step's {engine.max_rows}, skipped", file=sys.stderr)
            continue
        timed(f"mixed-{streams}+{p}x{length}-start", lambda: [d.mixed_batch(decoding, entering)], rows=rows,
              bucket=engine.rows_for(rows))
        timed(f"mixed-{streams}+{p}x{length}-no-start",
              lambda: [dataclasses.replace(d.mixed_batch(decoding, entering), starts=())], rows=rows,
              bucket=engine.rows_for(rows))
        starts = d.mixed_batch(decoding, entering).starts

        def start_only() -> float:
            begin = time.perf_counter()
            d.state = engine._start(d.state, *engine._starts(starts))
            jax.block_until_ready(d.state)
            return time.perf_counter() - begin

        for _ in range(2):
            start_only()
        times = [start_only() * 1e3 for _ in range(runs)]
        out.append({"name": f"start-{p}", "ms": statistics.median(times), "ms_min": min(times)})
        print(f"step probe start-{p}: {statistics.median(times):.2f} ms", file=sys.stderr, flush=True)
    return out


async def policy_points(engine: Any, args: argparse.Namespace, requests: list[Any], warm: list[Any]
                        ) -> list[dict[str, Any]]:
    from model_service.metrics import Metrics
    from model_service.scheduler import Scheduler

    points = []
    policies = [("slowdown", s) for s in args.slowdown] + [("prefill_rows", r) for r in args.prefill_rows]
    for run in range(args.runs):
        for kind, value in policies:
            kwargs = {"slowdown": value} if kind == "slowdown" else {"prefill_rows": int(value)}
            scheduler = Scheduler(engine, 4 * max(args.concurrency) + 16, Metrics(), **kwargs)
            scheduler.start()
            try:
                inner = InProcessSender(scheduler, 0.0)
                await warm_up(inner, warm, max(args.concurrency))
                steps = registry_steps(scheduler.metrics.registry)
                for c in args.concurrency:
                    for dead in args.dead_ms:
                        send = DeadTimeSender(inner, dead / 1e3, args.seed + run)
                        before = steps()
                        budgets: list[float] = []
                        sampler = asyncio.ensure_future(sample_budget(scheduler, budgets))
                        try:
                            served, duration = await run_point(send, requests, LoadPoint(c), args.seed)
                        finally:
                            sampler.cancel()
                        m = metrics.compute(served, duration)
                        m["prompt_budget_rows_p50"] = statistics.median(budgets) if budgets else 0.0
                        m.update(step_shape(before, steps(), m["total_output_tokens"]))
                        point = {"run": run, "policy": kind, "value": value, "concurrency": c, "dead_ms": dead,
                                 **{k: v for k, v in m.items() if not isinstance(v, list)}}
                        points.append(point)
                        print(f"closed loop run {run} {kind}={value:g} c{c} dead {dead:g} ms: "
                              f"{m['output_throughput']:.0f} tok/s, TTFT p50 {m['median_ttft_ms']:.1f} ms, TPOT p50 "
                              f"{m['median_tpot_ms']:.2f} ms, steps decode/mixed/prompt {m['steps_decode']:.0f}/"
                              f"{m['steps_mixed']:.0f}/{m['steps_prompt']:.0f} at {m['step_ms_decode']:.2f}/"
                              f"{m['step_ms_mixed']:.2f}/{m['step_ms_prompt']:.2f} ms, "
                              f"{m['tokens_per_step']:.1f} tokens a step, prompt budget p50 "
                              f"{m['prompt_budget_rows_p50']:.0f} rows, "
                              f"failed {m['failed']}",
                              file=sys.stderr, flush=True)
            finally:
                await asyncio.to_thread(scheduler.stop)
    return points


def summarise(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over runs per (policy, value, concurrency, dead time), with the ratio to the first policy's point
    at the smallest dead time of the same concurrency (the lockstep rounds layers' in-process arm measures)."""
    keys: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for p in points:
        keys.setdefault((p["policy"], p["value"], p["concurrency"], p["dead_ms"]), []).append(p)
    rows = []
    for (policy, value, c, dead), ps in keys.items():
        row: dict[str, Any] = {"policy": policy, "value": value, "concurrency": c, "dead_ms": dead, "runs": len(ps)}
        for k in ("output_throughput", "median_ttft_ms", "median_ttft_queue_ms", "median_tpot_ms", "steps_decode",
                  "steps_mixed", "steps_prompt", "step_ms_decode", "step_ms_mixed", "step_ms_prompt",
                  "tokens_per_step", "prompt_budget_rows_p50"):
            values = [p[k] for p in ps if k in p]
            if values:
                row[k] = statistics.median(values)
        rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["concurrency"] == row["concurrency"]
                    and r["dead_ms"] == min(x["dead_ms"] for x in rows) and (r["policy"], r["value"]) == (
                        rows[0]["policy"], rows[0]["value"]))
        row["throughput_ratio"] = row["output_throughput"] / base["output_throughput"]
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stack", default="golden", choices=["golden", "medium", "demo"])
    p.add_argument("--concurrency", type=_ints, default=(64,), help="closed-loop clients, comma-separated")
    p.add_argument("--dead-ms", type=_floats, default=(0.0, 10.0),
                   help="milliseconds a client waits between its requests, comma-separated")
    p.add_argument("--slowdown", type=_floats, default=(1.8,),
                   help="pacing factors (--decode-slowdown) to try ('' and no --prefill-rows: the step probe alone)")
    p.add_argument("--prefill-rows", type=_ints, default=(), help="fixed prompt budgets (--prefill-tokens) to try")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slots", type=int, default=None, help="model slots (default: the largest concurrency)")
    p.add_argument("--compile-cache", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's compute dtype")
    p.add_argument("--step-probe", action="store_true", help="first time single decode, mixed and start steps")
    p.add_argument("--probe-prompts", type=_ints, default=(1, 2, 8), help="prompts entering a probed mixed step")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    spec = dataclasses.replace(preset(args.stack, args.slots or max(args.concurrency), args.compile_cache),
                               dtype=args.dtype)
    begin = time.monotonic()
    engine = in_process_engine(spec)
    built = time.monotonic() - begin
    out: dict[str, Any] = {"benchmark": "closed_loop", "config": {k: v for k, v in vars(args).items()},
                           "stack": dataclasses.asdict(spec), **results.provenance(), "engine_build_s": built}
    if args.step_probe:
        streams = max(1, min(args.slots or max(args.concurrency), engine.slots) - max(args.probe_prompts))
        out["step_probe"] = step_probe(engine, streams, args.probe_prompts, args.input_len, 10)
    cutter = PromptCutter(spec.tokenizer)
    requests = build(WorkloadSpec("fixed", args.input_len, args.output_len, args.num_prompts, seed=args.seed), cutter)
    warm = build(WorkloadSpec("fixed", args.input_len, args.output_len, 8, seed=args.seed + 1), cutter)
    policies = args.slowdown or args.prefill_rows
    out["points"] = asyncio.run(policy_points(engine, args, requests, warm)) if policies else []
    out["summary"] = summarise(out["points"])
    text = json.dumps(out, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps(out["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
