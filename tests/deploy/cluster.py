"""A stand-in for a cluster: pods as local processes, their probes, and Service endpoints as DNS.

The kubelet's part: start a pod's container (`python -m ...` with its localized environment), run
its startup and readiness probes as the manifests define them (gRPC health checks and TCP
connects, with their periods and thresholds). The endpoints controller's part: a pod joins the
DNS answer of every headless Service that selects it once it is ready (at once for a Service that
publishes not-ready addresses), which is what a `dns:///` client sees when a Deployment scales.
"""

from __future__ import annotations

import pathlib
import signal
import socket
import subprocess
import time
from collections.abc import Mapping

from serving_common.healthcheck import check
from tests.deploy.dns import DnsServer
from tests.deploy.k8s import LocalPod, Pod, PodLocalizer, probe_handler, selects
from tests.deploy.stack import Process

POLL_SECONDS = 0.5


class LocalCluster:
    """The pods started so far, their processes, and the DNS server holding the endpoints."""

    def __init__(self, localizer: PodLocalizer, dns: DnsServer, base_env: Mapping[str, str],
                 workdir: pathlib.Path, log_dir: pathlib.Path) -> None:
        self.localizer = localizer
        self.dns = dns
        self.base_env = dict(base_env)
        self.workdir = workdir
        self.log_dir = log_dir
        self.pods: dict[str, LocalPod] = {}
        self.procs: dict[str, Process] = {}
        self.exit_codes: dict[str, int] = {}

    def start(self, pod: Pod) -> LocalPod:
        """Start the pod's container; services that publish not-ready addresses list it at once."""
        local = self.localizer.localize(pod)
        self.pods[pod.name] = local
        self.procs[pod.name] = Process(local, self.base_env | local.env, self.workdir, self.log_dir / f"{pod.name}.log")
        self._publish(local, ready=False)
        return local

    def probe(self, local: LocalPod, kind: str) -> bool:
        """One run of the container's `kind` probe (startupProbe, readinessProbe, livenessProbe)."""
        probe = local.pod.container()[kind]
        handler = probe_handler(probe)
        timeout = float(probe.get("timeoutSeconds", 1))
        if handler == "grpc":
            port = self.localizer.port(probe["grpc"]["port"])
            return check(f"{local.ip}:{port}", probe["grpc"].get("service", ""), timeout=timeout)
        assert handler == "tcpSocket", f"{local.pod.name}: {kind} uses {handler}, which this stand-in does not run"
        try:
            with socket.create_connection((local.ip, self.localizer.port(probe["tcpSocket"]["port"])), timeout):
                return True
        except OSError:
            return False

    def wait_ready(self, local: LocalPod) -> float:
        """Run the startup probe until it passes (within period x failureThreshold), then readiness;
        the pod then joins its Services' endpoints. Returns the monotonic time it became ready."""
        container = local.pod.container()
        for kind in ("startupProbe", "readinessProbe"):
            if kind not in container:
                continue
            probe = container[kind]
            deadline = time.monotonic() + float(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))
            while not self.probe(local, kind):
                proc = self.procs[local.pod.name].proc
                if proc.poll() is not None:
                    raise RuntimeError(f"{local.pod.name} exited with {proc.returncode}:\n{self.logs(local)[-4000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{local.pod.name} never passed its {kind}:\n{self.logs(local)[-4000:]}")
                time.sleep(POLL_SECONDS)
        self._publish(local, ready=True)
        return time.monotonic()

    def _publish(self, local: LocalPod, ready: bool) -> None:
        for name, service in self.localizer.services.items():
            spec = service["spec"]
            if spec.get("clusterIP") != "None" or not selects(spec.get("selector", {}), local.pod.labels):
                continue
            if ready or spec.get("publishNotReadyAddresses", False):
                current = tuple(self.dns.table.get(name, ()))
                if local.ip not in current:
                    self.dns.table[name] = (*current, local.ip)

    def logs(self, local: LocalPod) -> str:
        return self.procs[local.pod.name].logs()

    def stop(self) -> dict[str, int]:
        """SIGTERM every pod at once (as the kubelet does when their workloads are deleted), then SIGKILL each
        still running after its terminationGracePeriodSeconds; the exit codes."""
        running = [name for name in self.procs if name not in self.exit_codes]
        sent = time.monotonic()
        for name in running:
            if self.procs[name].proc.poll() is None:
                self.procs[name].proc.send_signal(signal.SIGTERM)
        for name in running:
            grace = float(self.pods[name].pod.spec.get("terminationGracePeriodSeconds", 30))
            proc = self.procs[name].proc
            try:
                proc.wait(max(0.0, sent + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.exit_codes[name] = proc.returncode
        return self.exit_codes
