"""The scheduling policy against a modelled accelerator: tokens/s, TTFT and steps by kind under closed-loop clients.

`model_service/plan.py` decides each step's rows and `model_service/pacing.py` sizes the prompt budget from measured
step times; both are pure, so this drives them with a clock of its own instead of a chip. A step of R rows costs
`--fixed-ms + --row-ms * bucket(R)` (the least row bucket holding it, as the accelerator's programs run them),
plus `--prompt-ms` if it computes prompt rows and `--start-ms` if it starts slots (both 0 by default; the chip's
step probe, `benchmarks.closed_loop --step-probe`, measured ~3.8 and ~1.8 ms on medium in float32), the
loop is pipelined as the model service's is (a step is planned when the one before the previous was delivered, so
an arrival waits for the step after the next), and `--concurrency` clients each send a request of `--input-len`
prompt tokens for `--output-len` tokens as soon as their last one ended, `--client-ms` after it (the gateway, the
tokenizer and the transport between them). `--burst` sends every request of a round at once and the next round
only when all ended: the in-process engine's pattern in `benchmarks.layers`.

Use it to compare policies (`--decode-slowdown`, the bucket fill) on the step costs a chip measured, before a chip
run; it is a model of the loop, not a measurement of the service: the numbers it prints are the model's.

    python -m benchmarks.schedule_sim --concurrency 64 --requests 256
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from typing import Any

from model_service.loop_state import STEP_KINDS, step_kind
from model_service.pacing import DEFAULT_SLOWDOWN, Pacing, rows_cost
from model_service.plan import Policy, Sample, View, Waiting, schedule

# Medium in float32 on one TPU v5e, from the stack's runs (benchmarks/measured/stack-uds-medium-tpu-v5e-*.json):
# a 64-row decode step ~6 ms, a 1,024-row prompt step ~25-27 ms; the buckets are the generic backend's.
FIXED_MS = 4.6
ROW_MS = 0.0219
BUCKETS = (16, 64, 128, 256, 512, 1024)


@dataclass
class Req:
    ref: int
    client: int
    arrived: float
    prompt: int
    output: int
    slot: int = -1
    computed: int = 0
    drawn: int = 0  # tokens drawn (in flight included)
    delivered: int = 0
    first_at: float = float("inf")  # its first token delivered
    done_at: float = 0.0


@dataclass
class Step:
    start: float
    end: float
    draws: list[int]  # refs that draw a token this step
    decoding: bool
    cost: float
    keys: float
    rows: int
    kind: str


def bucket(rows: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= rows), buckets[-1])


def simulate(args: argparse.Namespace, slowdown: float, fill: bool) -> dict[str, Any]:
    rng = random.Random(args.seed)
    buckets = tuple(b for b in BUCKETS if b <= args.max_rows)
    pacing = Pacing(float(args.initial_rows), float(args.max_rows), slowdown=slowdown)
    key_scale = args.key_scale
    clock = 0.0
    refs = iter(range(1 << 30))
    queue: list[Req] = []
    running: dict[int, Req] = {}
    free = set(range(args.concurrency))
    sent = 0
    ended: list[Req] = []
    arrivals: list[tuple[float, int]] = []  # (time, client)

    def send(client: int, at: float) -> None:
        nonlocal sent
        if sent < args.requests:
            sent += 1
            arrivals.append((at, client))

    for c in range(args.concurrency):
        send(c, 0.0 if args.burst else rng.uniform(0, args.client_ms) / 1e3)
    in_flight: list[Step] = []
    kinds = {kind: [0, 0.0] for kind in STEP_KINDS}
    last_end = 0.0
    while len(ended) < args.requests:
        # arrivals up to now join the queue
        arrivals.sort()
        while arrivals and arrivals[0][0] <= clock:
            at, client = arrivals.pop(0)
            queue.append(Req(next(refs), client, at, args.input_len, args.output_len))
        view = View(tuple(Waiting(r.ref, (Sample((r.ref, 0), -1, 0, r.prompt),), 0, False, r.arrived)
                          for r in queue),
                    tuple(Sample((r.ref, 0), r.slot, r.computed, r.prompt + r.drawn,
                                 done=r.drawn >= r.output, arrived=r.arrived, decoding_since=r.first_at,
                                 drawn=r.drawn) for r in running.values()),
                    frozenset(free))
        policy = Policy(args.max_rows, pacing.budget(), key_scale, args.concurrency, pacing.keys_per_row(),
                        pacing.min_rows, buckets if fill else ())
        plan = schedule(view, policy)
        by_ref = {r.ref: r for r in queue}
        for a in plan.admit:
            r = by_ref[a.ref]
            r.slot = a.slots[0]
            free.discard(r.slot)
            running[r.ref] = r
        queue = [r for r in queue if r.ref not in plan.admitted]
        draws, decoding, cost, keys, rows = [], False, 0.0, 0.0, 0
        for c in plan.chunks:
            r = running[c.key[0]]
            rows += c.rows
            if c.start >= r.prompt:
                decoding = True
            else:
                cost += rows_cost(c.start, c.rows, key_scale)
                keys += c.start
            r.computed = c.start + c.rows
            if c.draw:
                r.drawn += 1
                draws.append(r.ref)
        if not plan.chunks:
            # nothing to run: deliver what is in flight, else wait for the next arrival
            if not in_flight:
                if not arrivals:
                    break
                clock = max(clock, min(a for a, _ in arrivals))
                continue
        else:
            ms = args.fixed_ms + args.row_ms * bucket(rows, buckets) + (args.prompt_ms if cost else 0.0) + (
                args.start_ms if plan.admit else 0.0)
            start = max(clock, in_flight[-1].end if in_flight else clock)
            in_flight.append(Step(start, start + ms / 1e3, draws, decoding, cost, keys, rows,
                                  step_kind(decoding, cost)))
            if len(in_flight) < 2:
                continue  # the loop plans the next step before waiting for this one
        step = in_flight.pop(0)
        clock = max(clock, step.end)
        period = step.end - max(last_end, step.start)  # the loop's period: from its dispatch or the last delivery
        last_end = step.end
        pacing.observe(period, step.decoding, step.cost, step.keys)
        kinds[step.kind][0] += 1
        kinds[step.kind][1] += period * 1e3
        for ref in step.draws:
            r = running[ref]
            r.delivered += 1
            if r.delivered == 1:
                r.first_at = step.end
            if r.delivered >= r.output:
                r.done_at = step.end
                del running[ref]
                free.add(r.slot)
                ended.append(r)
                if not args.burst:
                    send(r.client, step.end + (args.client_ms + rng.uniform(0, args.client_spread_ms)) / 1e3)
        if args.burst and not running and not queue and not arrivals and not in_flight:
            for c in range(args.concurrency):
                send(c, clock)
    duration = max(r.done_at for r in ended) - min(r.arrived for r in ended)
    ttft = sorted((r.first_at - r.arrived) * 1e3 for r in ended)
    tokens = sum(r.output for r in ended)
    steps = sum(k[0] for k in kinds.values())
    return {"decode_slowdown": slowdown, "bucket_fill": fill, "requests": len(ended), "tokens": tokens,
            "tokens_per_s": tokens / duration,
            "ttft_p50_ms": ttft[len(ttft) // 2], "ttft_p90_ms": ttft[int(len(ttft) * 0.9)],
            "tokens_per_step": tokens / steps,
            "steps": {k: v[0] for k, v in kinds.items()},
            "step_ms": {k: (v[1] / v[0] if v[0] else 0.0) for k, v in kinds.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--client-ms", type=float, default=2.0, help="from a request's last token to its client's next "
                                                                 "request in the queue")
    p.add_argument("--client-spread-ms", type=float, default=0.0, help="plus a uniform random delay up to this")
    p.add_argument("--burst", action="store_true", help="rounds of requests sent together (the in-process pattern)")
    p.add_argument("--max-rows", type=int, default=1024)
    p.add_argument("--fixed-ms", type=float, default=FIXED_MS)
    p.add_argument("--row-ms", type=float, default=ROW_MS)
    p.add_argument("--prompt-ms", type=float, default=0.0,
                   help="what a step with prompt rows costs beyond its bucket (the chip: ~3.8, closed_loop's probe)")
    p.add_argument("--start-ms", type=float, default=0.0,
                   help="what a step that starts slots costs beyond that (the chip: ~1.8)")
    p.add_argument("--key-scale", type=float, default=float("inf"))
    p.add_argument("--initial-rows", type=int, default=64)
    p.add_argument("--decode-slowdown", default=str(DEFAULT_SLOWDOWN), help="comma-separated factors to compare")
    p.add_argument("--no-fill", action="store_true", help="also without the bucket fill")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = []
    for s in (float(x) for x in args.decode_slowdown.split(",")):
        for fill in ((True, False) if args.no_fill else (True,)):
            out.append(simulate(args, s, fill))
            print(json.dumps(out[-1]), file=sys.stderr)
    print(json.dumps({"benchmark": "schedule_sim", "settings": vars(args), "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
