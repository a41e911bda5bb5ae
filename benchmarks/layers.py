"""The cost of each layer: the same workload on the engine in-process, on the model service over gRPC
(token ids), and through the whole stack (gateway: text, tokenizer service, detokenization).

    python -m benchmarks.layers --stack golden --concurrency 1,8 --runs 3

All three arms use the same requests (the gateway arm sends the text, the others its token ids), the
same closed-loop runner and the same metric arithmetic (benchmarks.metrics). The in-process arm is the
model service's own Scheduler + Engine built in this process, timestamped in the decode thread's emit
callback: the floor the other two are compared with. Besides latencies and throughputs (wall clock,
which a busy machine disturbs), every run records the CPU milliseconds each process spent per output
token (from /proc; the benchmark process holds the client and, for the in-process arm, the engine),
which a busy machine does not change much, and how the model's decode loop stepped (the steps by kind, decode
only / mixed with prompt rows / prompt only, the loop's milliseconds per step of each kind and the output tokens
per step: from the in-process Scheduler's metrics, and from the model service's /metrics for the gRPC arms).
`startup` records the seconds from launching the stack to
SERVING (the model service compiling into an empty compilation cache) and to build the same engine
in-process afterwards (loading those programs from the cache). Arms are interleaved within each run.
`--baseline-gateway DIR` adds a fourth arm, a gateway run from another checkout's source (e.g. the main
branch) in front of the same services: a gateway change measured against its base in one invocation.
`--baseline-stack DIR` instead starts a whole second stack (tokenizer, model and gateway services) from
the other checkout and adds two arms, `model_service_baseline` and `gateway_baseline`, with that stack's
processes in the CPU table: a change to any of the services measured against its base in one invocation.
`--local-gateway` adds a `gateway_local` arm: a second gateway from this tree that detokenizes in-process
(`--detokenize local`) in front of the same services, beside the default remote DecodeStream gateway.
`--uds` runs every service on unix socket files (`--uds`: the way the stack runs on a host without TCP) and
`--per-call-gateway` adds a `gateway_per_call` arm: a second gateway from this tree on the earlier internal
protocol (`--model-streams 0 --detokenize remote`: a Generate call per request, a DecodeStream round trip per
model message) in front of the same services, so the GenerateMany hop and local detokenization are measured
against it in one invocation:

    python -m benchmarks.layers --stack demo --uds --per-call-gateway --concurrency 8,64 --runs 3

On an accelerator one process at a time holds the device: `--in-process-apart` measures the in-process
engine after the stack stopped (its runs then not interleaved with the others').
`--client-processes N` sends the gRPC arms' requests from N worker processes (benchmarks.client_pool) instead
of this one's event loop, so that the client is not what limits them at device speed; their CPU is reported as
`cpu_ms_per_token_clients` (and counted in the total).

Targets (issue 9): the gateway's output throughput at concurrency 8 >= 0.97x in-process and its TTFT p50
<= in-process + 2 ms. `stack_targets` (issue 63): the gateway >= 0.9x in-process at concurrency 8 and 64,
and the services' host CPU (tokenizer, model, gateway; not the client) <= 0.4 ms per generated token.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from benchmarks import metrics, results
from benchmarks.client_pool import ClientPool, SenderSpec
from benchmarks.loadgen import GatewaySender, LoadPoint, ModelSender, Sender, run_point, warm_up
from benchmarks.metrics import RequestResult
from benchmarks.stack import (
    ROOT,
    Process,
    RunningStack,
    StackSpec,
    preset,
    start_gateway,
    start_stack,
    use_model_xla_flags,
)
from benchmarks.workload import BenchRequest, PromptCutter, WorkloadSpec, build
from model_service.loop_state import STEP_KINDS
from serving_common.flags import EnvArgumentParser, positive_int
from serving_common.processes import unix_endpoint

ARMS = ("in_process", "model_service", "gateway")
THROUGHPUT_TARGET = 0.97  # gateway / in-process output throughput at concurrency 8
TTFT_TARGET_MS = 2.0  # gateway TTFT p50 - in-process TTFT p50


@dataclass(frozen=True)
class LayersConfig:
    stack: str = "golden"
    concurrency: tuple[int, ...] = (1, 8)
    input_len: int = 32
    output_len: int = 32
    num_prompts: int = 16
    runs: int = 3
    warmup: int = 4
    seed: int = 0
    temperature: float = 0.0
    slots: int | None = None
    compile_cache: str | None = None
    baseline_gateway: str | None = None  # source tree of a second gateway to compare with
    baseline_stack: str | None = None  # source tree of a second whole stack to compare with
    local_gateway: bool = False  # also measure a gateway with --detokenize local
    uds: bool = False  # every service on unix socket files instead of TCP ports
    per_call_gateway: bool = False  # also measure a gateway on the earlier protocol (a call per request)
    in_process_apart: bool = False  # the in-process arm after the stack stopped (an accelerator has one owner)
    dtype: str = "float32"  # the model service's --dtype (and the in-process engine's)
    client_processes: int = 1  # worker processes sending the gRPC arms' requests (1: this process)

    def __post_init__(self) -> None:
        if self.baseline_gateway and self.baseline_stack:
            raise ValueError("--baseline-gateway and --baseline-stack both add a gateway_baseline arm: give one")


class InProcessSender:
    """Submits straight to a Scheduler over an Engine in this process (no gRPC, no protobuf)."""

    def __init__(self, scheduler: Any, temperature: float) -> None:
        self.scheduler = scheduler
        self.temperature = temperature
        self.ids = itertools.count()

    async def __call__(self, request: BenchRequest) -> RequestResult:
        from model_service.requests import Emission, GenerationRequest, SchedulerError
        from model_service.sampling_settings import SamplingSettings

        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        result = RequestResult(prompt_len=request.prompt_len, start=time.perf_counter())

        def emit(emission: Emission) -> None:  # on the decode thread: the earliest a token exists
            now = time.perf_counter()
            if emission.tokens:
                result.chunk_times.append(now)
                result.chunk_tokens.append(len(emission.tokens))
            if emission.error is not None:
                result.error = f"{emission.error.kind.name}: {emission.error.message}"
            if emission.error is not None or emission.finish_reason is not None:
                result.end = now
                loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(None))

        try:
            self.scheduler.submit(GenerationRequest(
                request_id=f"bench-{next(self.ids)}", prompt=request.prompt_ids,
                sampling=SamplingSettings(temperature=self.temperature), max_tokens=request.output_len,
                ignore_eos=True), emit)
        except SchedulerError as error:
            result.error, result.end = f"{error.kind.name}: {error.message}", time.perf_counter()
            return result
        await finished
        return result

    async def close(self) -> None:
        await asyncio.to_thread(self.scheduler.stop)


def in_process_engine(spec: StackSpec) -> Any:
    """The model service's Engine for `spec`, compiled, exactly as the service builds it."""
    from model_service.__main__ import configure_jax
    from model_service.config import MeshConfig
    from model_service.server import ServerConfig, build_engine, resolve

    configure_jax(spec.compile_cache)
    config = ServerConfig(config=spec.config, checkpoint=spec.checkpoint, random_init=spec.checkpoint is None,
                          dtype=spec.dtype, mesh=MeshConfig(1, 1), slots=spec.slots,
                          max_queue=spec.max_queue)
    return build_engine(config, resolve(config))


def in_process_scheduler(spec: StackSpec) -> Any:
    """The model service's Engine (compiled) and Scheduler, exactly as the service builds them."""
    from model_service.metrics import Metrics
    from model_service.scheduler import Scheduler

    scheduler = Scheduler(in_process_engine(spec), spec.max_queue, Metrics())  # as the service counts
    scheduler.start()
    return scheduler


StepCounts = dict[str, tuple[float, float]]  # kind: (steps, the decode loop's seconds for them)


def _step_counts(value: Callable[[str, str], float | None]) -> StepCounts:
    return {kind: (value("grok_model_steps_total", kind) or 0.0,
                   value("grok_model_step_period_seconds_total", kind) or 0.0) for kind in STEP_KINDS}


def registry_steps(registry: Any) -> Callable[[], StepCounts]:
    """The step counts of an in-process Scheduler's metrics.Metrics."""
    return lambda: _step_counts(lambda name, kind: registry.get_sample_value(name, {"kind": kind}))


def scraped_steps(url: str) -> Callable[[], StepCounts | None]:
    """The step counts a model service's /metrics (`unix:PATH` or http://) reports."""
    from gateway.replica_metrics import scrape

    def read() -> StepCounts | None:
        values = {(s.name, s.labels.get("kind", "")): s.value for family in scrape(url) for s in family.samples}
        if not any(name == "grok_model_steps_total" for name, _ in values):
            return None  # a model service from before the step counters (a baseline tree)
        return _step_counts(lambda name, kind: values.get((name, kind)))
    return read


def step_shape(before: StepCounts, after: StepCounts, tokens: int) -> dict[str, float]:
    """How the model's decode loop ran during a run: its steps by kind (decode only, mixed with prompt rows,
    prompt only), the loop's mean milliseconds per step of each kind (a decoding stream's gap between tokens in
    such steps) and the output tokens per step. Why a layer's time per token differs from the in-process engine's:
    more steps (fewer tokens each), or slower ones."""
    out: dict[str, float] = {}
    total = 0.0
    for kind in STEP_KINDS:
        n = after[kind][0] - before[kind][0]
        total += n
        out[f"steps_{kind}"] = n
        out[f"step_ms_{kind}"] = (after[kind][1] - before[kind][1]) * 1e3 / n if n else 0.0
    out["tokens_per_step"] = tokens / total if total else 0.0
    return out


Watched = int | tuple[int, int]  # a process id, or (process id, thread id): one thread of it


def cpu_seconds(pid: Watched) -> float:
    """User + system CPU seconds so far of a process (all its threads), or of one thread, from /proc."""
    path = f"/proc/{pid}/stat" if isinstance(pid, int) else f"/proc/{pid[0]}/task/{pid[1]}/stat"
    fields = pathlib.Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def engine_process(pid: int) -> dict[str, Watched]:
    """{"model_engine": pid} of the model service's engine process (--engine-process), whose CPU its own
    /proc/PID/stat does not count; {} without one."""
    try:
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                if b"spawn_main" in pathlib.Path(f"/proc/{child}/cmdline").read_bytes():
                    return {"model_engine": int(child)}
    except OSError:  # a kernel without /proc/PID/task/TID/children, or a process that just ended
        pass
    return {}


def cpu_snapshot(pids: dict[str, Watched]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def loop_thread(pid: int) -> tuple[int, int]:
    """A service's main thread, which runs its event loop (gRPC, the servicer; in the model service not the decode
    thread or the compute threads): what the service spends around the model, apart from the model's compute."""
    return pid, pid


def cpu_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU milliseconds each process spent per output token during a run. Unlike wall-clock times this
    does not depend on what else the machine runs, so it shows each layer's cost on a busy machine."""
    per = {f"cpu_ms_per_token_{n}": (after[n] - before[n]) * 1e3 / max(tokens, 1) for n in before}
    per["cpu_ms_per_token_total"] = sum(v for n, v in per.items() if not n.endswith("_loop"))  # loops: counted in theirs
    return per


async def measure_arms(config: LayersConfig, senders: dict[str, Sender], requests: list[BenchRequest],
                       warm: list[BenchRequest], pids: dict[str, Watched], pool: ClientPool | None = None,
                       specs: dict[str, SenderSpec] | None = None,
                       steps: dict[str, Callable[[], StepCounts | None]] | None = None,
                       ) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every arm at every point, interleaved within each run; an arm in `specs` is sent from `pool`'s processes;
    an arm in `steps` also reports how its model's loop stepped (step_shape)."""
    specs = specs if pool is not None and specs else {}
    steps = steps or {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {arm: {} for arm in senders}
    for arm, send in senders.items():
        if arm in specs:
            warmed, _, _ = await pool.run_point(specs[arm], warm, LoadPoint(max(config.concurrency)))  # type: ignore[union-attr]
        else:
            warmed = await warm_up(send, warm, max(config.concurrency))
        failed = [r.error for r in warmed if not r.success]
        if failed:
            raise RuntimeError(f"{arm} warm-up failed: {failed[0]}")
    for index in range(config.runs):
        for c in config.concurrency:
            for arm, send in senders.items():
                before = cpu_snapshot(pids)
                stepped = steps[arm]() if arm in steps else None
                clients = None
                if arm in specs:
                    served, duration, clients = await pool.run_point(specs[arm], requests, LoadPoint(c),  # type: ignore[union-attr]
                                                                     config.seed)
                else:
                    served, duration = await run_point(send, requests, LoadPoint(c), config.seed)
                m = metrics.compute(served, duration)
                m.update(cpu_per_token(before, cpu_snapshot(pids), m["total_output_tokens"]))
                after = steps[arm]() if stepped is not None else None
                if stepped is not None and after is not None:
                    m.update(step_shape(stepped, after, m["total_output_tokens"]))
                if clients is not None:
                    m["cpu_ms_per_token_clients"] = clients * 1e3 / max(m["total_output_tokens"], 1)
                    m["cpu_ms_per_token_total"] += m["cpu_ms_per_token_clients"]
                runs[arm].setdefault(f"c{c}", []).append({k: v for k, v in m.items() if not isinstance(v, list)})
                print(f"layers run {index} c{c} {arm}: {m['output_throughput']:.1f} tok/s, TTFT p50 "
                      f"{m['median_ttft_ms']:.2f} ms"
                      + (f" (in the engine {m['median_ttft_engine_ms']:.2f}, queued {m['median_ttft_queue_ms']:.2f}; "
                         f"outside {m['median_ttft_outside_ms']:.2f})"
                         if "median_ttft_engine_ms" in m else "")
                      + f", TPOT p50 {m['median_tpot_ms']:.2f} ms, CPU "
                      f"{m['cpu_ms_per_token_total']:.2f} ms/token, failed {m['failed']}"
                      + (f", steps decode/mixed/prompt {m['steps_decode']:.0f}/{m['steps_mixed']:.0f}/"
                         f"{m['steps_prompt']:.0f} at {m['step_ms_decode']:.2f}/{m['step_ms_mixed']:.2f}/"
                         f"{m['step_ms_prompt']:.2f} ms" if "steps_decode" in m else ""),
                      file=sys.stderr, flush=True)
    return runs


def ratios(arms: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per point: each layer's throughput relative to in-process and its TTFT/TPOT p50 above it."""
    out = {}
    for point, base in arms["in_process"].items():
        row: dict[str, float] = {}
        for arm in [a for a in arms if a != "in_process"]:
            m = arms[arm][point]["median"]
            b = base["median"]
            row[f"{arm}_throughput_ratio"] = m["output_throughput"] / b["output_throughput"]
            row[f"{arm}_ttft_p50_extra_ms"] = m["median_ttft_ms"] - b["median_ttft_ms"]
            row[f"{arm}_tpot_p50_extra_ms"] = m["median_tpot_ms"] - b["median_tpot_ms"]
        out[point] = row
    return out


STACK_THROUGHPUT_TARGET = 0.9  # issue 63: gateway / in-process at concurrency 8 and 64
STACK_CPU_TARGET_MS = 0.4  # issue 63: host CPU of all services per generated token
SERVICES = ("tokenizer_service", "model_service", "gateway")


def stack_targets(arms: dict[str, dict[str, dict[str, Any]]], ratio_table: dict[str, dict[str, float]],
                  gateway_arm: str = "gateway") -> dict[str, Any]:
    """Issue 63's targets for `gateway_arm`: throughput ratio per point, and the services' CPU per token
    (the processes' medians summed; the benchmark process, client and in-process engine, left out).

    On a CPU host the model service's CPU includes the model's own compute, which the in-process engine spends
    too: `services_overhead_cpu_ms_per_token` is the services' CPU less the in-process arm's (its process: the
    engine and the load generator), the part the stack adds around the same engine; `services_loops_cpu_ms_per_token`
    the gateway and tokenizer service whole and the model service's event-loop thread alone (its servicer and
    gRPC, not the decode thread or the compute): the same part, measured rather than subtracted."""
    out: dict[str, Any] = {"throughput_target": STACK_THROUGHPUT_TARGET, "cpu_target_ms": STACK_CPU_TARGET_MS}
    for point, row in ratio_table.items():
        median = arms[gateway_arm][point]["median"]
        cpu = sum(median.get(f"cpu_ms_per_token_{name}", 0.0) for name in SERVICES)
        engine = arms["in_process"][point]["median"].get("cpu_ms_per_token_benchmark", 0.0)
        out[point] = {"throughput_ratio": row[f"{gateway_arm}_throughput_ratio"],
                      "throughput_met": row[f"{gateway_arm}_throughput_ratio"] >= STACK_THROUGHPUT_TARGET,
                      "services_cpu_ms_per_token": cpu, "cpu_met": cpu <= STACK_CPU_TARGET_MS,
                      "in_process_cpu_ms_per_token": engine, "services_overhead_cpu_ms_per_token": cpu - engine}
        if "cpu_ms_per_token_model_service_loop" in median:
            out[point]["services_loops_cpu_ms_per_token"] = (
                median["cpu_ms_per_token_model_service_loop"] + cpu - median.get("cpu_ms_per_token_model_service", 0.0))
    return out


def targets(ratio_table: dict[str, dict[str, float]]) -> dict[str, Any]:
    row = ratio_table.get("c8")
    if row is None:
        return {"note": "targets are stated at concurrency 8, which was not measured"}
    return {"gateway_throughput_ratio_c8": row["gateway_throughput_ratio"],
            "throughput_target": THROUGHPUT_TARGET,
            "throughput_met": row["gateway_throughput_ratio"] >= THROUGHPUT_TARGET,
            "gateway_ttft_p50_extra_ms_c8": row["gateway_ttft_p50_extra_ms"], "ttft_target_ms": TTFT_TARGET_MS,
            "ttft_met": row["gateway_ttft_p50_extra_ms"] <= TTFT_TARGET_MS}


async def _run(config: LayersConfig, spec: StackSpec, address: str | None, model_address: str | None,
               scheduler: Any, baselines: dict[str, str], pids: dict[str, Watched],
               model_metrics: str | None = None) -> dict[str, Any]:
    """The runs of every arm given: the in-process engine (`scheduler`), the stack (`address`, its model service's
    /metrics at `model_metrics`), the baselines."""
    cutter = PromptCutter(spec.tokenizer)
    requests = build(WorkloadSpec("fixed", config.input_len, config.output_len, config.num_prompts,
                                  seed=config.seed), cutter)
    warm = build(WorkloadSpec("fixed", config.input_len, config.output_len, config.warmup, seed=config.seed + 1),
                 cutter)
    senders: dict[str, Sender] = {}
    if scheduler is not None:
        senders["in_process"] = InProcessSender(scheduler, config.temperature)
    if address is not None and model_address is not None:
        senders["model_service"] = ModelSender(model_address, config.temperature)
        senders["gateway"] = GatewaySender(address, config.temperature)
    if "model_service" in baselines:
        senders["model_service_baseline"] = ModelSender(baselines["model_service"], config.temperature)
    if "gateway_local" in baselines:
        senders["gateway_local"] = GatewaySender(baselines["gateway_local"], config.temperature)
    if "gateway" in baselines:
        senders["gateway_baseline"] = GatewaySender(baselines["gateway"], config.temperature)
    if "gateway_per_call" in baselines:
        senders["gateway_per_call"] = GatewaySender(baselines["gateway_per_call"], config.temperature)
    pool = ClientPool(config.client_processes) if config.client_processes > 1 else None
    specs = {arm: SenderSpec("model" if isinstance(send, ModelSender) else "gateway", send.address,
                             config.temperature)
             for arm, send in senders.items() if isinstance(send, (ModelSender, GatewaySender))}
    steps: dict[str, Callable[[], StepCounts | None]] = {}
    if scheduler is not None and hasattr(scheduler.metrics, "registry"):
        steps["in_process"] = registry_steps(scheduler.metrics.registry)
    base_metrics = baselines.get("model_metrics")  # a baseline stack's own model service
    for arm in senders:
        own = base_metrics if arm in ("model_service_baseline", "gateway_baseline") and base_metrics else model_metrics
        if arm != "in_process" and own is not None:
            steps[arm] = scraped_steps(own)  # the model service behind the arm
    try:
        return await measure_arms(config, senders, requests, warm, pids, pool, specs, steps)
    finally:
        if pool is not None:
            pool.close()
        for send in senders.values():
            await send.close()


def _report(config: LayersConfig, spec: StackSpec, runs: dict[str, Any]) -> dict[str, Any]:
    arms = {arm: {point: metrics.aggregate(rs) for point, rs in by_point.items()} for arm, by_point in runs.items()}
    table = ratios(arms)
    return {"benchmark": "layers", "config": asdict(config), "stack": asdict(spec), **results.provenance(),
            "workload": f"fixed-in{config.input_len}-out{config.output_len}", "arms": arms, "ratios": table,
            "targets": targets(table), "stack_targets": stack_targets(arms, table),
            "transport": "unix sockets" if config.uds else "tcp", "load_average": os.getloadavg()}


@dataclass
class Extras:
    """The processes started beside the stack for the extra arms, their addresses (by arm) and their pids."""

    gateways: list[Process]
    stacks: list[RunningStack]
    addresses: dict[str, str]
    pids: dict[str, int]

    def stop(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        for stack in self.stacks:
            stack.close()


def start_extras(config: LayersConfig, spec: StackSpec, stack: RunningStack, logs: pathlib.Path,
                 sockets: pathlib.Path | None) -> Extras:
    """The baseline gateway or stack, the local and per-call gateways the config asks for; on socket files in
    `sockets` when the stack is (a host without TCP has no port to give them)."""
    extras = Extras([], [], {}, {})

    def gateway(arm: str, source: pathlib.Path, env: dict[str, str] | None, name: str) -> None:
        started = start_gateway(stack.tokenizer.address, stack.model.address, logs, source, env=env,
                                endpoint=None if sockets is None else unix_endpoint(sockets, name))
        extras.gateways.append(started)
        extras.addresses[arm] = started.address
        extras.pids["gateway_baseline" if arm == "gateway" else arm] = started.proc.pid

    try:
        if config.baseline_gateway:
            gateway("gateway", pathlib.Path(config.baseline_gateway).resolve(), None, "gw-base")
        if config.local_gateway:
            gateway("gateway_local", ROOT, {"GROK_GATEWAY_DETOKENIZE": "local"}, "gw-local")
        if config.per_call_gateway:
            gateway("gateway_per_call", ROOT,
                    {"GROK_GATEWAY_MODEL_STREAMS": "0", "GROK_GATEWAY_DETOKENIZE": "remote"},
                    "gateway-per-call")
        if config.baseline_stack:
            base_sockets = None if sockets is None else sockets / "base"
            if base_sockets is not None:
                base_sockets.mkdir()
            base = start_stack(spec, logs / "baseline", source=pathlib.Path(config.baseline_stack).resolve(),
                               uds_dir=base_sockets)  # its own log folder: the same file names
            extras.stacks.append(base)
            extras.addresses.update(gateway=base.address, model_service=base.model.address)
            if base.model_metrics is not None:
                extras.addresses["model_metrics"] = base.model_metrics
            extras.pids.update(gateway_baseline=base.gateway.proc.pid, model_service_baseline=base.model.proc.pid,
                               tokenizer_service_baseline=base.tokenizer.proc.pid)
    except BaseException:
        extras.stop()
        raise
    return extras


def run(config: LayersConfig) -> dict[str, Any]:
    cache = config.compile_cache or tempfile.mkdtemp(prefix="bench-jax-cache-")
    spec = replace(preset(config.stack, config.slots or max(config.concurrency), cache), dtype=config.dtype)
    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-logs-"))
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="grok-", dir="/tmp")) if config.uds else None  # paths <= 107 B
    begin = time.monotonic()
    stack = start_stack(spec, logs, uds_dir=sockets)
    startup = {"stack_to_serving_s": time.monotonic() - begin}  # the model compiles into an empty cache
    extras: Extras | None = None
    try:
        extras = start_extras(config, spec, stack, logs, sockets)
        pids: dict[str, Watched] = {
            "benchmark": os.getpid(), "model_service": stack.model.proc.pid,
            "tokenizer_service": stack.tokenizer.proc.pid, "gateway": stack.gateway.proc.pid, **extras.pids,
            "model_service_loop": loop_thread(stack.model.proc.pid), **engine_process(stack.model.proc.pid)}
        if "model_service_baseline" in extras.pids:
            pids["model_service_baseline_loop"] = loop_thread(extras.pids["model_service_baseline"])
        scheduler = None
        if not config.in_process_apart:
            begin = time.monotonic()
            scheduler = in_process_scheduler(spec)
            startup["in_process_engine_warm_cache_s"] = time.monotonic() - begin  # same programs, now cached
        runs = asyncio.run(_run(config, spec, stack.address, stack.model.address, scheduler, extras.addresses,
                                pids, stack.model_metrics))
    finally:
        if extras is not None:
            extras.stop()
        stack.close()
    if config.in_process_apart:  # the stack has let go of the accelerator: the engine in this process now
        begin = time.monotonic()
        scheduler = in_process_scheduler(spec)
        startup["in_process_engine_warm_cache_s"] = time.monotonic() - begin
        runs.update(asyncio.run(_run(config, spec, None, None, scheduler, {}, {"benchmark": os.getpid()})))
    return {**_report(config, spec, runs), "startup": startup}


def main(argv: Sequence[str] | None = None) -> int:
    p = EnvArgumentParser(env_prefix="GROK_BENCH", prog="python -m benchmarks.layers",
                          description=__doc__.split("\n\n")[0])
    p.add_env_argument("--stack", default="golden", choices=["golden", "medium", "demo"], help="preset stack")
    p.add_env_argument("--concurrency", default="1,8", help="closed-loop points, comma-separated")
    p.add_env_argument("--input-len", type=positive_int, default=32, help="prompt tokens")
    p.add_env_argument("--output-len", type=positive_int, default=32, help="generated tokens (ignore_eos)")
    p.add_env_argument("--num-prompts", type=positive_int, default=16, help="requests per run of a point")
    p.add_env_argument("--runs", type=positive_int, default=3, help="runs (medians and spread reported)")
    p.add_env_argument("--warmup", type=int, default=4, help="warm-up requests per arm, excluded")
    p.add_env_argument("--seed", type=int, default=0, help="workload seed")
    p.add_env_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_env_argument("--slots", type=positive_int, default=None, help="model slots (default: largest concurrency)")
    p.add_env_argument("--compile-cache", default=None, help="JAX compilation cache shared by both engines")
    p.add_env_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="the model's compute dtype, in the model service and in process")
    p.add_env_argument("--baseline-gateway", default=None,
                       help="source tree (e.g. /path/to/main checkout) of a second gateway measured as an extra arm")
    p.add_env_argument("--baseline-stack", default=None,
                       help="source tree of a second whole stack (tokenizer, model, gateway) measured as two extra "
                            "arms, model_service_baseline and gateway_baseline")
    p.add_env_argument("--local-gateway", action="store_true",
                       help="also measure a gateway that detokenizes in-process (--detokenize local) as arm "
                            "gateway_local")
    p.add_env_argument("--uds", action="store_true",
                       help="run every service on unix socket files (--uds) instead of TCP ports")
    p.add_env_argument("--per-call-gateway", action="store_true",
                       help="also measure a gateway on the earlier internal protocol (--model-streams 0 "
                            "--detokenize remote) as arm gateway_per_call")
    p.add_env_argument("--in-process-apart", action="store_true",
                       help="measure the in-process engine after the stack stopped instead of interleaved with it: "
                            "on an accelerator (a TPU chip) one process at a time can hold the device")
    p.add_env_argument("--client-processes", type=positive_int, default=1,
                       help="worker processes sending the gRPC arms' requests, the concurrency split among them "
                            "(1: this process's event loop)")
    p.add_env_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    use_model_xla_flags()
    config = LayersConfig(stack=args.stack, concurrency=tuple(int(c) for c in args.concurrency.split(",")),
                          input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                          runs=args.runs, warmup=args.warmup, seed=args.seed, temperature=args.temperature,
                          slots=args.slots, compile_cache=args.compile_cache, baseline_gateway=args.baseline_gateway,
                          baseline_stack=args.baseline_stack, local_gateway=args.local_gateway, uds=args.uds,
                          per_call_gateway=args.per_call_gateway, in_process_apart=args.in_process_apart,
                          client_processes=args.client_processes, dtype=args.dtype)
    report = run(config)
    if args.out:
        results.write_json(pathlib.Path(args.out), report)
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
