"""The faults a chaos run injects into a LocalStack under traffic, and what it measures of them.

Each fault returns a plain dict for the report: what was done, how long the stack took to answer a
seeded request correctly again (recovery), how the traffic's calls ended meanwhile. The model
replicas' Prometheus metrics give the slot-reclaim times and whether every slot came back.
"""

from __future__ import annotations

import collections
import re
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc

from benchmarks.chaos_load import Seeded, Traffic, burst, wait_until
from benchmarks.chaos_stack import LocalStack, Proc
from gateway.client import generate_request
from grok.gateway.v1 import gateway_pb2_grpc

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def scrape(port: int) -> dict[str, float]:
    """A /metrics page as {'name{labels}': value} ({} when the endpoint does not answer)."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out = {}
    for line in body.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


def good_answer(address: str, seeded: Sequence[Seeded]) -> bool:
    """The gateway answers the first seeded request with its expected text."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = gateway_pb2_grpc.GatewayServiceStub(channel).Complete(seeded[0].request(), timeout=30)
    except grpc.RpcError:
        return False
    return reply.text == seeded[0].expected


def _during(traffic: Traffic, before: collections.Counter[tuple[str, str]]) -> dict[str, int]:
    window = traffic.outcomes.snapshot() - before
    totals: collections.Counter[str] = collections.Counter()
    for (_, outcome), n in window.items():
        totals[outcome] += n
    return dict(sorted(totals.items()))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def kill_and_restart(stack: LocalStack, proc: Proc, traffic: Traffic, seeded: Sequence[Seeded],
                     down_seconds: float) -> dict[str, Any]:
    """kill -9 `proc`, leave it down for `down_seconds` under traffic, start it again on its port."""
    before = traffic.outcomes.snapshot()
    began = time.monotonic()
    proc.kill()
    gateway_down = wait_until(lambda: not stack.gateway.serving(), timeout=max(down_seconds, 0.5))
    time.sleep(max(0.0, down_seconds - (time.monotonic() - began)))
    answered_while_down = good_answer(stack.gateway.address, seeded)
    proc.start()
    restart = proc.wait_serving()
    recovered = wait_until(lambda: good_answer(stack.gateway.address, seeded), timeout=120)
    return {"fault": f"kill -9 {proc.name}", "down_seconds": down_seconds,
            "gateway_not_serving_after_seconds": _round(gateway_down),
            "seeded_request_answered_while_down": answered_while_down, "restart_to_serving_seconds": _round(restart),
            "answered_after_serving_seconds": _round(recovered),
            "recovery_seconds": _round(time.monotonic() - began if recovered is not None else None),
            "calls_during": _during(traffic, before)}


def sigterm_and_restart(stack: LocalStack, proc: Proc, traffic: Traffic, seeded: Sequence[Seeded]) -> dict[str, Any]:
    """SIGTERM `proc` under traffic (it drains), then start it again."""
    before = traffic.outcomes.snapshot()
    began = time.monotonic()
    code = proc.terminate(timeout=stack.config.grace_seconds + 20)
    drained = time.monotonic() - began
    proc.start()
    restart = proc.wait_serving()
    recovered = wait_until(lambda: good_answer(stack.gateway.address, seeded), timeout=120)
    return {"fault": f"SIGTERM {proc.name}", "exit_code": code, "drain_seconds": _round(drained),
            "restart_to_serving_seconds": _round(restart), "answered_after_serving_seconds": _round(recovered),
            "recovery_seconds": _round(time.monotonic() - began if recovered is not None else None),
            "calls_during": _during(traffic, before)}


class _Streams:
    """`count` Generate streams of `tokens` tokens each, on threads; each records how it ended."""

    def __init__(self, address: str, count: int, tokens: int) -> None:
        self.address, self.tokens = address, tokens
        self.outcomes: list[str] = []
        self.started = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._one, daemon=True) for _ in range(count)]
        for t in self.threads:
            t.start()

    def _one(self) -> None:
        request = generate_request("In the beginning", max_tokens=self.tokens, ignore_eos=True)
        with grpc.insecure_channel(self.address) as channel:
            try:
                stream = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request, timeout=120)
                messages = [next(stream)]
                with self._lock:
                    self.started += 1
                messages += list(stream)
                outcome = "OK" if messages[-1].usage.completion_tokens == self.tokens else "SHORT"
            except grpc.RpcError as error:
                outcome = error.code().name
        with self._lock:
            self.outcomes.append(outcome)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


def sigterm_tokenizer_with_streams_in_flight(stack: LocalStack, seeded: Sequence[Seeded], streams: int, tokens: int,
                                             traffic: Traffic | None = None) -> dict[str, Any]:
    """SIGTERM the tokenizer while `streams` long streams are in flight, more than the replicas have slots (the
    rest wait in a model queue, already encoded), then start it again. Every stream the gateway admitted must
    finish: `in_flight_lost` counts those that did not (refused ones, RESOURCE_EXHAUSTED, were never in flight)."""
    before = traffic.outcomes.snapshot() if traffic is not None else collections.Counter()
    running = _Streams(stack.gateway.address, streams, tokens)
    decoding = min(streams, stack.config.replicas * stack.config.slots)
    wait_until(lambda: running.started >= decoding, timeout=120, step=0.05)

    def queued() -> float:
        return sum(scrape(stack.metrics_port(m)).get("grok_model_queue_depth", 0.0) for m in stack.models)

    # The rest are encoded and waiting in a model's queue (a fixed pause let the first ones finish on a quick box,
    # leaving none waiting at the signal).
    wait_until(lambda: queued() >= streams - decoding, timeout=30, step=0.01)
    running_at_signal = streams - len(running.outcomes)
    began = time.monotonic()
    code = stack.tokenizer.terminate(timeout=stack.config.grace_seconds + 20)
    drained = time.monotonic() - began
    running.join(120)
    stack.tokenizer.start()
    restart = stack.tokenizer.wait_serving()
    recovered = wait_until(lambda: good_answer(stack.gateway.address, seeded), timeout=120)
    outcomes = collections.Counter(running.outcomes)
    in_flight = streams - outcomes.get("RESOURCE_EXHAUSTED", 0)
    return {"fault": f"SIGTERM tokenizer, {streams} streams in flight", "exit_code": code,
            "drain_seconds": _round(drained), "in_flight": in_flight, "in_flight_lost": in_flight - outcomes["OK"],
            "running_at_signal": running_at_signal, "decoding_at_signal": decoding,
            "stream_outcomes": dict(sorted(outcomes.items())), "restart_to_serving_seconds": _round(restart),
            "answered_after_serving_seconds": _round(recovered),
            "recovery_seconds": _round(time.monotonic() - began if recovered is not None else None),
            "calls_during": _during(traffic, before) if traffic is not None else {}}


def overload(stack: LocalStack, long_tokens: int) -> dict[str, Any]:
    """Twice the stack's admission capacity (slots + queue, every replica) at the same instant."""
    capacity = stack.config.replicas * (stack.config.slots + stack.config.max_queue)
    outcomes = burst(stack.gateway.address, 2 * capacity, long_tokens)
    return {"fault": f"burst of {2 * capacity} long requests (2 x capacity {capacity})", "outcomes": dict(outcomes),
            "accepted": outcomes.get("OK", 0), "capacity": capacity}


def slots_free(stack: LocalStack, timeout: float = 30.0) -> dict[str, Any]:
    """Every replica back to 0 busy slots and an empty queue (no slot leaked)."""
    def idle() -> bool:
        pages = [scrape(stack.metrics_port(m)) for m in stack.models]
        return all(p.get("grok_model_active_slots") == 0 and p.get("grok_model_queue_depth") == 0 for p in pages)
    seconds = wait_until(idle, timeout, step=0.2)
    return {"all_free": seconds is not None, "seconds_after_traffic_stopped": _round(seconds)}


def reclaim_stats(stack: LocalStack) -> dict[str, Any]:
    """Slot reclaim after cancels/deadlines, summed over the replicas' current processes."""
    pages = [scrape(stack.metrics_port(m)) for m in stack.models]
    out: dict[str, Any] = {}
    for reason in ("cancelled", "deadline"):
        count = sum(p.get(f'grok_model_slot_reclaim_seconds_count{{reason="{reason}"}}', 0.0) for p in pages)
        total = sum(p.get(f'grok_model_slot_reclaim_seconds_sum{{reason="{reason}"}}', 0.0) for p in pages)
        buckets = _buckets(pages, "grok_model_slot_reclaim_seconds_bucket", {"reason": reason})
        out[reason] = {"slots_reclaimed": int(count), "mean_seconds": _round(total / count if count else None),
                       "p99_at_most_seconds": _quantile_bound(buckets, count, 0.99)}
    steps = _buckets(pages, "grok_model_steps_after_cancel_bucket", {})
    cancels = sum(p.get("grok_model_steps_after_cancel_count", 0.0) for p in pages)
    out["decode_steps_after_cancel_at_most"] = _quantile_bound(steps, cancels, 1.0)
    return out


def _buckets(pages: Sequence[dict[str, float]], name: str, labels: dict[str, str]) -> list[tuple[float, float]]:
    """Cumulative histogram buckets (upper bound, count) of `name` with `labels`, summed over pages."""
    merged: collections.Counter[float] = collections.Counter()
    for page in pages:
        for key, value in page.items():
            metric, _, rest = key.partition("{")
            found = dict(re.findall(r'(\w+)="([^"]*)"', rest))
            if metric == name and "le" in found and all(found.get(k) == v for k, v in labels.items()):
                merged[float(found["le"])] += value
    return sorted(merged.items())


def _quantile_bound(buckets: list[tuple[float, float]], count: float, q: float) -> float | None:
    """The smallest bucket bound holding a fraction q of the observations."""
    for bound, cumulative in buckets:
        if count and cumulative >= q * count:
            return bound
    return None
