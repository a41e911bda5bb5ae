"""The serving benchmark: sweep workloads x load points through the gateway, several runs each.

Runs are interleaved (run 1 of every point, then run 2 of every point, ...) so slow drifts of a
shared machine spread over all points instead of biasing one. Every run is written as its own JSON
file in `vllm bench serve`'s layout; the summary holds per point the median over runs and the
min..max spread.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from benchmarks import box, metrics, plots, results
from benchmarks.loadgen import GatewaySender, LoadPoint, Sender, run_point, warm_up
from benchmarks.metrics import RequestResult, Slo
from benchmarks.stack import RunningStack, preset, start_stack
from benchmarks.workload import BenchRequest, PromptCutter, WorkloadSpec, build
from grok.gateway.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class ServeConfig:
    """Everything one `python -m benchmarks` invocation measures (parsed once from flags)."""

    workloads: tuple[WorkloadSpec, ...]
    points: tuple[LoadPoint, ...]
    stack: str | None = "golden"  # preset to start; None: use `address`
    address: str | None = None
    tokenizer: str | None = None  # SentencePiece file of the served model (presets know theirs)
    slots: int | None = None  # model slots of a started stack (default: the largest concurrency)
    runs: int = 3
    warmup: int = 4
    seed: int = 0
    percentiles: tuple[float, ...] = (50, 90, 99)
    slo: Slo = Slo()
    temperature: float = 0.0
    top_p: float = 1.0
    result_dir: str = "benchmarks/measured/local"
    label: str = "serve"
    plots: bool = True
    compile_cache: str | None = None


def stack_slots(config: ServeConfig) -> int:
    if config.slots:
        return config.slots
    limits = [p.concurrency for p in config.points if p.concurrency]
    return max(limits) if limits else 8


def point_key(workload: WorkloadSpec, point: LoadPoint) -> str:
    return f"{workload.name}/{point.label}"


def run_record(config: ServeConfig, workload: WorkloadSpec, point: LoadPoint, index: int, computed: dict[str, Any],
               served: list[RequestResult], context: dict[str, Any]) -> dict[str, Any]:
    """A run file: vLLM's header keys, the computed metrics, and where/what was measured."""
    return {
        "date": context["date"], "backend": "grok-gateway-grpc", "endpoint_type": "grpc",
        "label": config.label, "model_id": context["model_id"], "tokenizer_id": context["tokenizer_id"],
        "num_prompts": workload.num_prompts, **point.as_dict(), **computed,
        "run_index": index, "point_label": point.label, "goodput_slo_ms": config.slo.as_dict() or None,
        "prompt_len_mismatches": sum(1 for r in served if r.success and r.server_prompt_tokens not in
                                     (-1, r.prompt_len)),
        "workload": {**asdict(workload), "name": workload.name},
        "config": _config_dict(config), "git": context["git"], "machine": results.machine_info(),
    }


def _config_dict(config: ServeConfig) -> dict[str, Any]:
    out = asdict(config)
    out["points"] = [p.as_dict() for p in config.points]
    out["workloads"] = [w.name for w in config.workloads]
    return out


async def model_context(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        info = await gateway_pb2_grpc.GatewayServiceStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=60)
    return int(info.model.config.sequence_len)


async def sweep(config: ServeConfig, send: Sender, workloads: dict[WorkloadSpec, list[BenchRequest]],
                warmups: dict[WorkloadSpec, list[BenchRequest]], context: dict[str, Any],
                out_dir: pathlib.Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    pooled: dict[str, list[RequestResult]] = {}
    for workload, requests in warmups.items():
        warm = await warm_up(send, requests, max(p.concurrency or 1 for p in config.points))
        failed = [r.error for r in warm if not r.success]
        if failed:
            raise RuntimeError(f"warm-up requests failed ({len(failed)}): {failed[0]}")
    for index in range(config.runs):
        for workload, requests in workloads.items():
            for point in config.points:
                watch = box.CpuWatch(services=config.stack is None)
                watch.start()
                served, duration = await run_point(send, requests, point, config.seed)
                shared = watch.stop()
                computed = metrics.compute(served, duration, config.percentiles, config.slo)
                record = run_record(config, workload, point, index, computed, served, context)
                record["box"] = shared.as_dict() if shared is not None else None
                box.warn_if_busy(shared, f"{point_key(workload, point)} run {index}")
                key = point_key(workload, point)
                name = f"{workload.name}__{point.label}__run{index}.json"
                results.write_json(out_dir / "runs" / name, record)
                runs.setdefault(key, []).append(record)
                pooled.setdefault(key, []).extend(served)
                print(progress_line(key, index, computed), file=sys.stderr, flush=True)
    return summarize(config, runs, pooled, context)


def progress_line(key: str, index: int, m: dict[str, Any]) -> str:
    return (f"{key} run {index}: {m['completed']} ok {m['failed']} failed, {m['request_throughput']:.2f} req/s, "
            f"{m['output_throughput']:.1f} tok/s, TTFT p50 {m['median_ttft_ms']:.1f} ms, "
            f"TPOT p50 {m['median_tpot_ms']:.2f} ms, ITL p99 {m.get('p99_itl_ms', 0.0):.2f} ms")


def summarize(config: ServeConfig, runs: dict[str, list[dict[str, Any]]], pooled: dict[str, list[RequestResult]],
              context: dict[str, Any]) -> dict[str, Any]:
    points = []
    for key, records in runs.items():
        first = records[0]
        points.append({
            "key": key, "workload": first["workload"], "load": {k: first[k] for k in
                                                               ("max_concurrency", "request_rate", "burstiness")},
            "runs": len(records), **metrics.aggregate(records),
            "itl_quantiles_ms": metrics.itl_quantiles(pooled[key]),
            "prompt_len_mismatches": sum(r["prompt_len_mismatches"] for r in records),
            "box": [r.get("box") for r in records],
        })
    shared = [b for p in points for b in p["box"] if b is not None and not b["quiet"]]
    return {"benchmark": "serve", "label": config.label,
            "shared_machine_runs": len(shared), "backend": "grok-gateway-grpc",
            "model_id": context["model_id"], "tokenizer_id": context["tokenizer_id"], "date": context["date"],
            "git": context["git"], "machine_at_start": context["machine"], "machine_at_end": results.machine_info(),
            "config": _config_dict(config), "points": points}


def prepare(config: ServeConfig, tokenizer: str, context_len: int) -> tuple[dict, dict]:
    cutter = PromptCutter(tokenizer)
    workloads = {w: build(w, cutter, context_len) for w in config.workloads}
    warmups = {w: build(WorkloadSpec(w.kind, w.input_len, w.output_len, config.warmup, w.range_ratio,
                                     w.seed + 10_000), cutter, context_len)
               for w in config.workloads} if config.warmup else {}
    return workloads, warmups


async def measure(config: ServeConfig, address: str, tokenizer: str, model_id: str,
                  out_dir: pathlib.Path) -> dict[str, Any]:
    workloads, warmups = prepare(config, tokenizer, await model_context(address))
    context = {**results.provenance(), "model_id": model_id, "tokenizer_id": tokenizer}
    send = GatewaySender(address, config.temperature, top_p=config.top_p)
    try:
        return await sweep(config, send, workloads, warmups, context, out_dir)
    finally:
        await send.close()


def run(config: ServeConfig) -> dict[str, Any]:
    """Start the preset stack (or use `address`), run the sweep, write runs, summary and plots."""
    out_dir = pathlib.Path(config.result_dir)
    stack: RunningStack | None = None
    if config.stack:
        spec = preset(config.stack, stack_slots(config), config.compile_cache)
        stack = start_stack(spec, pathlib.Path(tempfile.mkdtemp(prefix="bench-logs-")))
        address, tokenizer, model_id = stack.address, config.tokenizer or spec.tokenizer, spec.config
    else:
        if not config.address or not config.tokenizer:
            raise ValueError("without --stack, give --address HOST:PORT of a gateway and --tokenizer PATH of the "
                             "SentencePiece model it serves")
        address, tokenizer, model_id = config.address, config.tokenizer, config.address
    try:
        summary = asyncio.run(measure(config, address, tokenizer, model_id, out_dir))
    finally:
        if stack is not None:
            stack.close()
    results.write_json(out_dir / "summary.json", summary)
    if config.plots:
        summary["plots"] = [str(p) for p in plots.all_plots(summary, out_dir, config.label)]
    return summary


def load_points(concurrency: Sequence[int], rates: Sequence[float], burstiness: float,
                max_concurrency: int | None) -> tuple[LoadPoint, ...]:
    """Closed-loop points for each concurrency, then open-loop points for each rate."""
    out = [LoadPoint(c) for c in concurrency]
    out += [LoadPoint(max_concurrency, r, burstiness) for r in rates]
    if not out:
        raise ValueError("no load points: give --concurrency and/or --request-rate")
    return tuple(out)
