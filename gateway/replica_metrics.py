"""One /metrics for the whole deployment: the gateway's series, each model replica's, and vLLM's names beside ours.

The gateway scrapes the replicas' own /metrics endpoints (`--model-metrics URL[,URL...]`) when it is scraped
itself, labels each replica's samples `replica="HOST:PORT"`, and adds the vLLM-named copies (gateway/vllm_names.py).
A URL whose host name resolves to several addresses (a compose service scaled to N, a Kubernetes headless
Service) is scraped at each address. A replica that does not answer within the timeout is left out and
reported by `grok_gateway_model_metrics_up{replica} 0`, so a scrape never fails because one replica is down.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from gateway.vllm_names import vllm_aliases
from serving_common.uds import UnixHTTPConnection, path_of

SCRAPE_TIMEOUT = 2.0  # seconds a replica's /metrics may take


def scrape_targets(url: str) -> list[tuple[str, str]]:
    """(replica label, URL) for each address `url`'s host resolves to (one, for an IP address or a unix socket)."""
    if url.startswith("unix:"):
        return [(url, url)]
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return [(f"{host}:{port}", url)]  # reported down when scraped
    addresses = sorted({info[4][0] for info in infos})
    if len(addresses) <= 1:
        return [(f"{host}:{port}", url)]
    targets = []
    for address in addresses:
        netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        targets.append((netloc, urlunsplit(parts._replace(netloc=netloc))))
    return targets


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT) -> list[Metric]:
    """The families a /metrics endpoint serves; OSError (URLError included) when it cannot be read."""
    if (path := path_of(url)) is not None:
        text = scrape_unix(path, timeout)
    else:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            text = reply.read().decode("utf-8")
    return list(text_string_to_metric_families(text))


def scrape_unix(path: str, timeout: float) -> str:
    """GET /metrics from the socket file `path` (a model service's --metrics-uds)."""
    connection = UnixHTTPConnection(path, timeout)
    try:
        connection.request("GET", "/metrics")
        reply = connection.getresponse()
        if reply.status != 200:
            raise OSError(f"{path}: /metrics answered {reply.status}")
        return reply.read().decode("utf-8")
    finally:
        connection.close()


def _labelled(families: Iterable[Metric], replica: str) -> Iterator[Metric]:
    for family in families:
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp)
                        for s in family.samples if not s.name.endswith("_created")]  # a replica of an older release
        yield copy


def merge(families: Iterable[Metric]) -> list[Metric]:
    """Families of the same name (one per replica) as one family holding all their samples."""
    merged: dict[str, Metric] = {}
    for family in families:
        if family.name in merged:
            merged[family.name].samples.extend(family.samples)
        else:
            merged[family.name] = family
    return list(merged.values())


class ReplicaMetrics(Collector):
    """A collector of the model replicas' series, scraped when collected (in the scraping thread)."""

    def __init__(self, urls: Sequence[str], timeout: float = SCRAPE_TIMEOUT) -> None:
        self.urls = tuple(urls)
        self.timeout = timeout

    def collect(self) -> Iterator[Metric]:
        targets = [target for url in self.urls for target in scrape_targets(url)]
        if not targets:
            return
        up = Metric("grok_gateway_model_metrics_up", "Whether the last scrape of a model replica's /metrics "
                    "(--model-metrics) answered", "gauge")
        with ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
            results = list(pool.map(self._scrape_one, targets))
        families: list[Metric] = []
        for (replica, _), found in zip(targets, results):
            up.add_sample("grok_gateway_model_metrics_up", {"replica": replica}, 0.0 if found is None else 1.0)
            families += _labelled(found or [], replica)
        yield up
        yield from merge(families)

    def _scrape_one(self, target: tuple[str, str]) -> list[Metric] | None:
        try:
            return scrape(target[1], self.timeout)
        except (OSError, ValueError, urllib.error.URLError):
            return None


class Exposition(Collector):
    """What the gateway's /metrics serves: its own series, the replicas', and vLLM-named copies of both.

    `keep` filters families by name (the HTTP API's route leaves tenant-revealing ones out when keys are set).
    """

    def __init__(self, own: CollectorRegistry, replicas: ReplicaMetrics, model_name: str,
                 keep: Callable[[str], bool] = lambda name: True) -> None:
        self.own, self.replicas, self.model_name, self.keep = own, replicas, model_name, keep

    def collect(self) -> Iterator[Metric]:
        families = [*self.own.collect(), *self.replicas.collect()]
        for family in [*families, *vllm_aliases(families, self.model_name)]:
            if self.keep(family.name):
                yield family


def exposition_registry(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
