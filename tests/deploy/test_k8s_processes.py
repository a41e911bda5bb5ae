"""The Kubernetes manifests run as local processes: their commands, environment, ports and probes work,
and a model replica added to a running stack gets traffic without restarting the gateway.

The base (the demo stack, what `kubectl apply -k deploy/k8s/base` runs) is rendered by kustomize and
each pod started with exactly its container's command and environment (image paths -> local folders,
each pod its own loopback address, Service names answered by a local DNS server that lists a pod
once its readiness probe passes, as a headless Service does). Then a second model pod is started
under load, the way `kubectl scale deployment/grok-model` would, and must receive requests within
the bound the model service's connection age and gRPC's re-resolution rate give.
"""

from __future__ import annotations

import os
import pathlib
import re
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from gateway.client import GatewayClient
from tests.deploy.cluster import LocalCluster
from tests.deploy.compose import dockerfile_instructions, image_environment, local_path, stage
from tests.deploy.conftest import compile_cache_volume
from tests.deploy.dns import DnsServer
from tests.deploy.k8s import (
    BASE, K8S, Manifests, PodLocalizer, container_ports, render)
from tests.procs import free_port

pytestmark = pytest.mark.slow

# gRPC's DNS resolver re-resolves at most once per 30 s (grpc.dns_min_time_between_resolutions_ms).
GRPC_MIN_SECONDS_BETWEEN_RESOLUTIONS = 30.0
# gRPC core jitters the maximum connection age by +-10%.
AGE_JITTER = 1.1
SLACK_SECONDS = 15.0


def local_cluster(manifests: Manifests, image_app: pathlib.Path, tmp: pathlib.Path, dns: DnsServer) -> LocalCluster:
    """Pods of `manifests` on this machine, in a stand-in for the image's /app."""
    paths = {"/app": image_app, "/var/cache/grok": compile_cache_volume()}
    ports = {p: free_port() for p in container_ports(manifests)}
    localizer = PodLocalizer(manifests, paths, f"127.0.0.1:{dns.port}", ports)
    instructions = dockerfile_instructions()
    image_env = {k: local_path(v, paths) for k, v in image_environment(instructions).items() if k != "PATH"}
    (workdir,) = [local_path(rest, paths) for kw, rest in stage(instructions, "runtime") if kw == "WORKDIR"]
    base_env = {**os.environ, **image_env, "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}
    logs = tmp / "logs"
    logs.mkdir()
    return LocalCluster(localizer, dns, base_env, pathlib.Path(workdir), logs)


def generated_tokens(address: str) -> float:
    """grok_model_generated_tokens_total of a model pod's /metrics (0 before its first request)."""
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^grok_model_generated_tokens_total(?:\{[^}]*\})? (\S+)$", body, re.M))


@pytest.fixture(scope="module")
def manifests() -> Manifests:
    return Manifests(render(BASE))


@pytest.fixture(scope="module")
def cluster(manifests: Manifests, image_app: pathlib.Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One tokenizer, one model and one gateway pod of the base, each started once the pods it needs
    are ready (Kubernetes starts them together; the order only keeps this machine's two cores calm)."""
    dns = DnsServer({})
    running = local_cluster(manifests, image_app, tmp_path_factory.mktemp("k8s"), dns)
    try:
        for name in ("grok-tokenizer", "grok-model", "grok-gateway"):
            (pod, *_) = manifests.pods(manifests.get("Deployment", name))
            running.wait_ready(running.start(pod))
        yield running
    finally:
        running.stop()
        dns.close()


def gateway_address(cluster: LocalCluster) -> str:
    (gateway,) = [p for p in cluster.pods.values() if p.pod.labels["app.kubernetes.io/component"] == "gateway"]
    return f"{gateway.ip}:{gateway.ports[50051]}"


def test_every_pod_passes_its_startup_readiness_and_liveness_probes(cluster: LocalCluster) -> None:
    for local in cluster.pods.values():
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert cluster.probe(local, kind), (local.pod.name, kind)


def test_gateway_streams_a_completion_through_the_service_names(cluster: LocalCluster) -> None:
    with GatewayClient(gateway_address(cluster)) as client:
        messages = list(client.generate("Serving on two cores", max_tokens=5, ignore_eos=True, seed=3))
    assert messages[-1].usage.completion_tokens == 5
    assert ("grok-model", 1) in cluster.dns.queries and ("grok-tokenizer", 1) in cluster.dns.queries


class Load:
    """Requests through the gateway from background threads until stopped; every outcome is kept. One caller
    by default: traffic on every connection the gateway holds, without keeping both cores busy for the half
    minute the test waits for the gateway to find the added replica."""

    def __init__(self, address: str, threads: int = 1) -> None:
        self.address = address
        self.stopped = threading.Event()
        self.errors: list[str] = []
        self.completed = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def _run(self, seed: int) -> None:
        with GatewayClient(self.address) as client:
            while not self.stopped.is_set():
                try:
                    client.complete(f"load {seed}", max_tokens=4, ignore_eos=True, seed=seed, timeout=60)
                    self.completed += 1
                    self.stopped.wait(0.05)
                except grpc.RpcError as error:
                    self.errors.append(f"{error.code().name}: {error.details()}")

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=90)


def test_model_replica_added_under_load_gets_traffic_without_restarting_the_gateway(
        cluster: LocalCluster, manifests: Manifests) -> None:
    deployment = manifests.get("Deployment", "grok-model")
    first, second = manifests.pods(deployment, replicas=2)
    (config_map,) = [c for c in manifests.by_kind["ConfigMap"] if c["metadata"]["name"].startswith("grok-model-env")]
    age = float(config_map["data"]["GROK_MODEL_MAX_CONNECTION_AGE_SECONDS"])
    bound = AGE_JITTER * age + GRPC_MIN_SECONDS_BETWEEN_RESOLUTIONS + SLACK_SECONDS
    gateway_pid = next(p for n, p in cluster.procs.items() if n.startswith("grok-gateway")).proc.pid
    with Load(gateway_address(cluster)) as load:
        added = cluster.wait_ready(cluster.start(second))  # `kubectl scale --replicas=2` + its readiness probe
        metrics = f"{cluster.pods[second.name].ip}:{cluster.pods[second.name].ports[9090]}"
        while generated_tokens(metrics) == 0 and time.monotonic() - added < bound:
            time.sleep(1)
        waited = time.monotonic() - added
        served_before = load.completed
        time.sleep(3)  # requests keep succeeding while connections to the first replica are renewed
    assert generated_tokens(metrics) > 0, f"the added replica got no request within {bound:.0f} s"
    assert next(p for n, p in cluster.procs.items() if n.startswith("grok-gateway")).proc.pid == gateway_pid
    assert load.errors == [] and load.completed > served_before, (load.errors[:5], load.completed)
    first_metrics = f"{cluster.pods[first.name].ip}:{cluster.pods[first.name].ports[9090]}"
    assert generated_tokens(first_metrics) > 0
    print(f"added replica served its first request {waited:.1f} s after it became ready (bound {bound:.0f} s)")


def test_sigterm_stops_every_pod_with_exit_code_0(cluster: LocalCluster) -> None:
    # Runs last in this module: it stops the stack, as deleting the pods would.
    codes = cluster.stop()
    assert codes == {name: 0 for name in codes} and len(codes) == len(cluster.pods)


def test_multiprocess_group_serves_a_completion_through_the_gateway(
        image_app: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The demo-multiprocess overlay: leader and worker pods (started together, as podManagementPolicy
    Parallel does) join one replica that the gateway reaches through grok-model like any other."""
    manifests = Manifests(render(K8S / "overlays" / "demo-multiprocess"))
    dns = DnsServer({})
    running = local_cluster(manifests, image_app, tmp_path_factory.mktemp("k8s-group"), dns)
    try:
        running.wait_ready(running.start(manifests.pods(manifests.get("Deployment", "grok-tokenizer"))[0]))
        group = [running.start(pod) for name in ("grok-model-leader", "grok-model-worker")
                 for pod in manifests.pods(manifests.get("StatefulSet", name))]
        for local in group:
            running.wait_ready(local)
        running.wait_ready(running.start(manifests.pods(manifests.get("Deployment", "grok-gateway"))[0]))
        assert running.dns.table["grok-model"] == (group[0].ip,)  # only process 0 serves gRPC
        with GatewayClient(gateway_address(running)) as client:
            reply = client.complete("two processes", max_tokens=4, ignore_eos=True, seed=1, timeout=120)
        assert reply.usage.completion_tokens == 4
        # Deleting the pods SIGTERMs them together: process 0 drains and shuts the group down; none is killed.
        codes = running.stop()
        failed = {name: running.logs(running.pods[name])[-2000:] for name, code in codes.items() if code}
        assert codes == {name: 0 for name in codes}, failed
    finally:
        running.stop()
        dns.close()
