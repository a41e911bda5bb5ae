"""vLLM's metric names beside ours, so that dashboards built for vLLM (its Grafana example, KServe's, llm-d's)
read a grok-serve deployment unchanged.

Each alias is a copy of one of our families under vLLM's name, its samples labelled `model_name` (the served
model name, as vLLM labels every series). The table is the single list of what maps onto what
(docs/metrics.md renders it); an alias is derived at scrape time, so it never drifts from our series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Metric
from prometheus_client.samples import Sample

Relabel = Callable[[dict[str, str]], dict[str, str] | None]  # None drops the sample


def _success(labels: dict[str, str]) -> dict[str, str] | None:
    """grok_gateway_requests{method,code,finish_reason} -> vLLM's request_success{finished_reason}: finished
    requests by why they ended (stop, length; abort for any other status than OK)."""
    out = {k: v for k, v in labels.items() if k not in ("code", "finish_reason")}
    if labels.get("code") != "OK":
        out["finished_reason"] = "abort"
    else:
        out["finished_reason"] = "length" if labels.get("finish_reason") == "LENGTH" else "stop"
    return out


@dataclass(frozen=True)
class Alias:
    ours: str  # our family name (a counter's without _total)
    vllm: tuple[str, ...]  # vLLM's names for it (v1's, and v0's where dashboards still use it)
    relabel: Relabel | None = None
    help: str = ""  # the copy's HELP text when ours no longer fits it


ALIASES: tuple[Alias, ...] = (
    # the gateway's: requests as a client sees them
    Alias("grok_gateway_time_to_first_token_seconds", ("vllm:time_to_first_token_seconds",)),
    Alias("grok_gateway_inter_token_latency_seconds",
          ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")),
    Alias("grok_gateway_request_duration_seconds", ("vllm:e2e_request_latency_seconds",)),
    Alias("grok_gateway_prompt_tokens", ("vllm:prompt_tokens",)),
    Alias("grok_gateway_completion_tokens", ("vllm:generation_tokens",)),
    Alias("grok_gateway_requests", ("vllm:request_success",), _success,
          "Finished requests by method and finished_reason (stop, length; abort: any status but OK)"),
    # each model replica's (labelled replica="HOST:PORT")
    Alias("grok_model_active_slots", ("vllm:num_requests_running",)),
    Alias("grok_model_queue_depth", ("vllm:num_requests_waiting",)),
    Alias("grok_model_kv_cache_usage_perc", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    Alias("grok_model_num_preemptions", ("vllm:num_preemptions",)),
    Alias("grok_model_prefix_cache_queries", ("vllm:prefix_cache_queries",)),
    Alias("grok_model_prefix_cache_hits", ("vllm:prefix_cache_hits",)),
    Alias("grok_model_spec_decode_num_draft_tokens", ("vllm:spec_decode_num_draft_tokens",)),
    Alias("grok_model_spec_decode_num_accepted_tokens", ("vllm:spec_decode_num_accepted_tokens",)),
)
_BY_NAME = {alias.ours: alias for alias in ALIASES}


def _renamed(family: Metric, name: str, model_name: str, alias: Alias) -> Metric:
    copy = Metric(name, alias.help or family.documentation, family.type, family.unit)
    relabel = alias.relabel
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        labels = relabel(dict(sample.labels)) if relabel else dict(sample.labels)
        if labels is None:
            continue
        key = (name + sample.name[len(family.name):], tuple(sorted({**labels, "model_name": model_name}.items())))
        merged[key] = merged.get(key, 0.0) + sample.value  # a relabel may fold several samples into one
    copy.samples = [Sample(sample_name, dict(labels), value) for (sample_name, labels), value in merged.items()]
    return copy


def vllm_aliases(families: Iterable[Metric], model_name: str) -> list[Metric]:
    """vLLM-named copies of those of `families` that have one (see ALIASES)."""
    out = []
    for family in families:
        alias = _BY_NAME.get(family.name)
        if alias is not None:
            out += [_renamed(family, name, model_name, alias) for name in alias.vllm]
    return out
