"""Prometheus metrics of the model service, in a registry of their own (so tests can run several).

The scheduler reports slots, queue depth, step durations, tokens and finish reasons through the
`SchedulerMetrics` hooks; the servicer counts finished RPCs by gRPC status code.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from model_service.kv_blocks import KVUsage
from model_service.loop_state import STEP_KINDS, SchedulerMetrics
from model_service.requests import FinishReason
from serving_common.metrics_server import new_registry, serve_metrics, serve_metrics_unix

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics(SchedulerMetrics):
    """The model service's metrics; `serve(port)` exposes them on /metrics."""

    def __init__(self) -> None:
        self.registry = new_registry()
        r = self.registry
        self.active_slots = Gauge("grok_model_active_slots", "Batch slots holding a request", registry=r)
        self.queue_depth = Gauge("grok_model_queue_depth", "Requests waiting for a slot", registry=r)
        self.prefill_seconds = Histogram("grok_model_prefill_seconds", "Duration of one prefill",
                                         buckets=_STEP_BUCKETS, registry=r)
        self.decode_step_seconds = Histogram("grok_model_decode_step_seconds", "Duration of one decode step "
                                             "(all slots)", buckets=_STEP_BUCKETS, registry=r)
        self.steps = Counter("grok_model_steps", "Steps run, by kind: decode (only decode rows), mixed (decode "
                             "and prompt rows), prompt (only prompt rows)", ["kind"], registry=r)
        self.step_period_seconds = Counter("grok_model_step_period_seconds", "The decode loop's seconds per step, "
                                           "by kind: from the previous step's delivery (or this step's dispatch, "
                                           "if later) to this step's; over grok_model_steps, a decoding stream's "
                                           "gap between tokens in such steps", ["kind"], registry=r)
        self.generated_tokens = Counter("grok_model_generated_tokens", "Tokens generated", registry=r)
        self.finish_reasons = Counter("grok_model_requests_finished", "Requests that completed, by finish reason",
                                      ["finish_reason"], registry=r)
        self.status_codes = Counter("grok_model_requests", "Generate calls by final gRPC status code",
                                    ["code"], registry=r)
        self.reclaim_seconds = Histogram("grok_model_slot_reclaim_seconds", "From a running request's cancel or "
                                         "deadline to its slot being free", ["reason"], buckets=_STEP_BUCKETS,
                                         registry=r)
        self.steps_after_cancel = Histogram("grok_model_steps_after_cancel", "Decode steps run for a request "
                                            "after it was cancelled, before its slot was freed",
                                            buckets=(0, 1, 2, 4, 8, 16, 64), registry=r)
        self.kv_blocks = Gauge("grok_model_kv_blocks", "KV pool blocks by state: used (held by running sequences), "
                               "cached (kept for prefix reuse, evictable) or free", ["state"], registry=r)
        self.kv_usage = Gauge("grok_model_kv_cache_usage_perc", "Fraction of KV pool blocks held by running "
                              "sequences (vLLM's kv_cache_usage_perc)", registry=r)
        self.preemptions = Counter("grok_model_num_preemptions", "Running requests preempted because the KV pool "
                                   "ran out of blocks (recomputed later)", registry=r)
        self.spec_drafts = Counter("grok_model_spec_decode_num_draft_tokens", "Speculative draft tokens verified",
                                   registry=r)
        self.spec_accepted = Counter("grok_model_spec_decode_num_accepted_tokens", "Speculative draft tokens that "
                                     "counted (each the token decoding without speculation draws)", registry=r)
        self.prefix_queries = Counter("grok_model_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache", registry=r)
        self.prefix_hits = Counter("grok_model_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                   registry=r)
        self._prefix_seen = (0, 0)
        self._by_kind = {kind: (self.steps.labels(kind), self.step_period_seconds.labels(kind)) for kind in STEP_KINDS}

    def set_active(self, n: int) -> None:
        self.active_slots.set(n)

    def set_queued(self, n: int) -> None:
        self.queue_depth.set(n)

    def observe_prefill(self, seconds: float) -> None:
        self.prefill_seconds.observe(seconds)

    def observe_step(self, seconds: float, kind: str = "decode", period: float | None = None) -> None:
        self.decode_step_seconds.observe(seconds)
        steps, period_seconds = self._by_kind[kind]
        steps.inc()
        period_seconds.inc(seconds if period is None else period)

    def add_tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)

    def finished(self, reason: FinishReason) -> None:
        self.finish_reasons.labels(finish_reason=reason.value).inc()

    def observe_reclaim(self, reason: str, seconds: float, steps: int | None) -> None:
        self.reclaim_seconds.labels(reason=reason).observe(max(seconds, 0.0))
        if steps is not None:
            self.steps_after_cancel.observe(steps)

    def observe_kv(self, usage: KVUsage | None) -> None:
        if usage is None:
            return
        for state, n in (("used", usage.used), ("cached", usage.cached), ("free", usage.free)):
            self.kv_blocks.labels(state=state).set(n)
        self.kv_usage.set(usage.used / usage.total if usage.total else 0.0)
        queries, hits = self._prefix_seen
        self.prefix_queries.inc(max(0, usage.queries - queries))
        self.prefix_hits.inc(max(0, usage.hits - hits))
        self._prefix_seen = (usage.queries, usage.hits)

    def preempted(self) -> None:
        self.preemptions.inc()

    def speculated(self, drafted: int, accepted: int) -> None:
        self.spec_drafts.inc(drafted)
        self.spec_accepted.inc(accepted)

    def rpc_done(self, code_name: str) -> None:
        self.status_codes.labels(code=code_name).inc()

    def serve(self, port: int, host: str = "127.0.0.1", uds: str | None = None) -> None:
        """Start the /metrics HTTP endpoint (a daemon thread): on the socket file `uds` if given, else host:port."""
        if uds is not None:
            serve_metrics_unix(uds, self.registry)
        else:
            serve_metrics(port, host, self.registry, "turn it off with --metrics-port 0, or serve /metrics on a unix "
                          "socket file with --metrics-uds PATH")
