"""The gateway's one /metrics: its own series, each model replica's (scraped from --model-metrics), vLLM's names
beside ours, no `_created` series; a replica that is down is reported, not fatal."""

from __future__ import annotations

import re
import socket

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.__main__ import parse_config
from gateway.metrics import GatewayMetrics
from gateway.replica_metrics import scrape_targets
from gateway.vllm_names import ALIASES
from model_service.kv_blocks import KVUsage
from model_service.metrics import Metrics
from model_service.requests import FinishReason
from tests.procs import ROOT, free_port


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= ls]
    assert len(matches) == 1, (name, labels, [k for k in found if k[0] == name])
    return matches[0]


@pytest.fixture
def replica() -> tuple[Metrics, int]:
    """A model service's metrics, served as the service serves them, with some traffic recorded."""
    metrics, port = Metrics(), free_port()
    metrics.serve(port)
    metrics.set_active(3)
    metrics.set_queued(2)
    metrics.add_tokens(40)
    metrics.finished(FinishReason.LENGTH)
    metrics.preempted()
    metrics.speculated(8, 5)
    metrics.observe_kv(KVUsage(used=3, cached=1, free=4, total=8, queries=10, hits=6))
    return metrics, port


def test_one_metrics_holds_the_gateway_s_and_each_replica_s_series_with_vllm_names(
        replica: tuple[Metrics, int]) -> None:
    _, port = replica
    gateway = GatewayMetrics([f"http://127.0.0.1:{port}/metrics"], model_name="demo")
    gateway.time_to_first_token.labels("Complete").observe(0.03)
    gateway.completion_tokens.inc(40)
    gateway.prompt_tokens.inc(7)
    gateway.finished("Complete", "OK", "LENGTH", 0.5)
    gateway.finished("Complete", "CANCELLED", "NONE", 0.1)
    text = generate_latest(gateway.exposition).decode()
    found = samples(text)
    at = f"127.0.0.1:{port}"
    assert value(found, "grok_gateway_model_metrics_up", replica=at) == 1.0
    assert value(found, "grok_model_active_slots", replica=at) == 3.0
    assert value(found, "grok_model_generated_tokens_total", replica=at) == 40.0
    assert value(found, "vllm:num_requests_running", replica=at, model_name="demo") == 3.0
    assert value(found, "vllm:num_requests_waiting", replica=at, model_name="demo") == 2.0
    assert value(found, "vllm:kv_cache_usage_perc", replica=at) == pytest.approx(3 / 8)
    assert value(found, "vllm:gpu_cache_usage_perc", replica=at) == pytest.approx(3 / 8)
    assert value(found, "vllm:num_preemptions_total", replica=at) == 1.0
    assert value(found, "vllm:prefix_cache_hits_total", replica=at) == 6.0
    assert value(found, "vllm:spec_decode_num_accepted_tokens_total", replica=at) == 5.0
    assert value(found, "vllm:generation_tokens_total", model_name="demo") == 40.0
    assert value(found, "vllm:prompt_tokens_total", model_name="demo") == 7.0
    assert value(found, "vllm:time_to_first_token_seconds_count", method="Complete") == 1.0
    assert value(found, "vllm:e2e_request_latency_seconds_count", method="Complete") == 2.0
    assert value(found, "vllm:request_success_total", finished_reason="length") == 1.0
    assert value(found, "vllm:request_success_total", finished_reason="abort") == 1.0
    assert "_created" not in text


def test_every_alias_names_a_series_the_gateway_or_a_replica_has(replica: tuple[Metrics, int]) -> None:
    _, port = replica
    gateway = GatewayMetrics([f"http://127.0.0.1:{port}/metrics"])
    names = {family.name for family in text_string_to_metric_families(generate_latest(gateway.exposition).decode())}
    for alias in ALIASES:
        assert alias.ours in names, alias.ours
        assert set(alias.vllm) <= names, alias.vllm


def test_a_replica_that_does_not_answer_is_reported_down_and_the_rest_still_served() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        gateway = GatewayMetrics([f"http://127.0.0.1:{port}/metrics"])
        gateway.prompt_tokens.inc(2)
        found = samples(generate_latest(gateway.exposition).decode())
    assert value(found, "grok_gateway_model_metrics_up", replica=f"127.0.0.1:{port}") == 0.0
    assert value(found, "grok_gateway_prompt_tokens_total") == 2.0


def test_the_api_s_metrics_route_leaves_prefix_cache_series_out_when_keys_are_set(
        replica: tuple[Metrics, int]) -> None:
    _, port = replica
    gateway = GatewayMetrics([f"http://127.0.0.1:{port}/metrics"])
    assert "prefix_cache" in generate_latest(gateway.exposition).decode()
    tenant = generate_latest(gateway.tenant_exposition).decode()
    assert "prefix_cache" not in tenant and "vllm:num_requests_running" in tenant


def test_a_model_service_s_own_metrics_have_no_created_series(replica: tuple[Metrics, int]) -> None:
    metrics, _ = replica
    assert "_created" not in generate_latest(metrics.registry).decode()


def test_a_name_with_several_addresses_is_scraped_at_each() -> None:
    assert scrape_targets("http://127.0.0.1:9091/metrics") == [("127.0.0.1:9091", "http://127.0.0.1:9091/metrics")]
    several = scrape_targets("http://localhost:9091/metrics")  # 127.0.0.1 and ::1 where both are configured
    assert all(url.endswith(":9091/metrics") and "localhost" not in url for _, url in several) or len(several) == 1


def test_model_metrics_flag_is_checked_and_parsed() -> None:
    config = parse_config(["--tokenizer", "t:1", "--model", "m:2",
                           "--model-metrics", "http://a:9091/metrics, http://b:9091/metrics"])
    assert config.model_metrics == ("http://a:9091/metrics", "http://b:9091/metrics")
    with pytest.raises(SystemExit):
        parse_config(["--tokenizer", "t:1", "--model", "m:2", "--model-metrics", "a:9091"])


def test_docs_metrics_md_lists_exactly_the_aliases_of_gateway_vllm_names() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    section = text.split("## vLLM's names", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(grok_[a-z_]+)` \| ([^|]+) \|", section, re.M)
    documented = {(ours.removesuffix("_total"), tuple(n.removesuffix("_total") for n in re.findall(r"`([^`]+)`", names)))
                  for ours, names in rows}
    assert documented == {(alias.ours, alias.vllm) for alias in ALIASES}
