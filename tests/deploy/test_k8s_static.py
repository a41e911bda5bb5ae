"""Static checks of deploy/k8s: every overlay renders with kustomize, validates against the Kubernetes
schemas, and says what the deployment promises (gRPC probes on grpc.health.v1, headless Services the
gateway balances over, a multi-host group whose names give the coordinator and process ids, the
compose file's settings, non-root pods, disruption budgets, devices that match the mesh)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections.abc import Callable

import kubernetes_validate
import pytest

from gateway.__main__ import parse_config
from grok.gateway.v1 import gateway_pb2
from grok.model.v1 import model_pb2
from grok.tokenizer.v1 import tokenizer_pb2
from model_service.__main__ import parser as model_parser
from tests.deploy.compose import COMPOSE_FILE, resolved_config
from tests.deploy.k8s import BASE, OVERLAYS, Manifests, Pod, probe_handler, render, selects
from tokenizer_service.__main__ import parse_args as tokenizer_parse_args

# The oldest Kubernetes the manifests need (StatefulSet start ordinals and the pod-index label are GA
# in 1.32) and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.32.0", "1.37.0")
DIRECTORIES = {p.name: p for p in (BASE, *OVERLAYS)}
GRPC_SERVICES = {"tokenizer": tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name,
                 "model": model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
                 "gateway": gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name}
DEVICE_RESOURCES = ("nvidia.com/gpu", "google.com/tpu")
GROUP_VARIABLES = {"GROK_MODEL_COORDINATOR", "GROK_MODEL_NUM_PROCESSES", "GROK_MODEL_PROCESS_ID"}
PARSERS: dict[str, Callable[[], object]] = {
    "tokenizer": lambda: tokenizer_parse_args([]), "model": lambda: model_parser().parse_args([]),
    "gateway": lambda: parse_config([])}


@pytest.fixture(scope="module")
def rendered() -> dict[str, Manifests]:
    return {name: Manifests(render(path)) for name, path in DIRECTORIES.items()}


def component(pod: Pod) -> str:
    return pod.labels["app.kubernetes.io/component"]


def is_follower(pod: Pod) -> bool:
    return pod.labels.get("grok-serve.io/model-role") == "follower"


def test_overlays_cover_single_host_gpus_multi_host_gpus_tpus_and_the_demo_group() -> None:
    assert set(DIRECTORIES) == {"base", "grok1-gpu", "grok1-gpu-multihost", "grok1-tpu-multihost", "demo-multiprocess"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_overlay_validates_strictly_against_the_kubernetes_schemas(rendered: dict[str, Manifests],
                                                                         version: str) -> None:
    problems = []
    for name, manifests in rendered.items():
        for doc in manifests.docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                problems.append(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {error.message}")
    assert problems == []


def test_schema_validation_rejects_a_misspelled_field(rendered: dict[str, Manifests]) -> None:
    broken = copy.deepcopy(rendered["base"].get("Deployment", "grok-model"))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_grpc_servers_are_probed_over_grpc_health_and_followers_not_at_all(rendered: dict[str, Manifests]) -> None:
    for name, manifests in rendered.items():
        for pod in manifests.all_pods():
            container = pod.container()
            probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}
            if is_follower(pod):  # no gRPC API to probe; it exits when its coordinator goes away
                assert probes == {}, (name, pod.name)
                continue
            grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
            handlers = {k: probe_handler(p) for k, p in probes.items()}
            liveness = "tcpSocket" if component(pod) == "gateway" else "grpc"
            assert handlers == {"startupProbe": "grpc", "readinessProbe": "grpc", "livenessProbe": liveness}, pod.name
            assert all(probes[k][h]["port"] == grpc_port for k, h in handlers.items()), pod.name
            assert probes["readinessProbe"]["grpc"]["service"] == GRPC_SERVICES[component(pod)], pod.name


def test_model_start_up_may_take_what_compose_allows_and_an_hour_for_grok1(rendered: dict[str, Manifests]) -> None:
    compose_start = {"base": 600, "demo-multiprocess": 600}
    for name, manifests in rendered.items():
        for pod in manifests.all_pods():
            if component(pod) == "model" and not is_follower(pod):
                probe = pod.container()["startupProbe"]
                assert probe["periodSeconds"] * probe["failureThreshold"] == compose_start.get(name, 3600), pod.name


def test_every_service_selects_pods_that_have_its_target_ports(rendered: dict[str, Manifests]) -> None:
    for name, manifests in rendered.items():
        for service in manifests.by_kind["Service"]:
            pods = manifests.selected(service["spec"]["selector"])
            assert pods, f"{name}: Service {service['metadata']['name']} selects no pod"
            for port in service["spec"].get("ports", []):
                for pod in pods:
                    names = {p["name"] for p in pod.container().get("ports", [])}
                    assert port["targetPort"] in names, (name, service["metadata"]["name"], pod.name, port)


def test_gateway_balances_over_headless_services_listing_only_grpc_servers(rendered: dict[str, Manifests]) -> None:
    for name, manifests in rendered.items():
        (gateway,) = manifests.pods(manifests.get("Deployment", "grok-gateway"), replicas=1)
        env = manifests.environment(gateway)
        for variable, target in (("GROK_GATEWAY_TOKENIZER", "tokenizer"), ("GROK_GATEWAY_MODEL", "model")):
            match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", env[variable])
            assert match, f"{name}: {variable}={env[variable]} is not a dns:/// target"
            service = manifests.get("Service", match[1])
            assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses")
            assert int(match[2]) in {p["port"] for p in service["spec"]["ports"]}
            pods = manifests.selected(service["spec"]["selector"])
            assert pods and {component(p) for p in pods} == {target}
            assert not any(is_follower(p) for p in pods), f"{name}: {match[1]} lists pods without a gRPC API"
            assert all("readinessProbe" in p.container() for p in pods)


def test_pods_run_as_non_root_without_privileges_on_a_read_only_root(rendered: dict[str, Manifests]) -> None:
    for name, manifests in rendered.items():
        for pod in manifests.all_pods():
            security = pod.spec["securityContext"]
            assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, (name, pod.name)
            assert pod.spec["automountServiceAccountToken"] is False
            for container in pod.spec["containers"]:
                context = container["securityContext"]
                assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
                assert context["capabilities"]["drop"] == ["ALL"] and "privileged" not in context


def test_every_pod_has_a_disruption_budget_of_one_at_a_time(rendered: dict[str, Manifests]) -> None:
    for name, manifests in rendered.items():
        budgets = manifests.by_kind["PodDisruptionBudget"]
        for pod in manifests.all_pods():
            covering = [b for b in budgets if selects(b["spec"]["selector"]["matchLabels"], pod.labels)]
            assert len(covering) == 1, (name, pod.name, [b["metadata"]["name"] for b in covering])
            assert covering[0]["spec"]["maxUnavailable"] == 1 and "minAvailable" not in covering[0]["spec"]


def test_base_environment_is_the_compose_files(rendered: dict[str, Manifests]) -> None:
    compose = resolved_config(COMPOSE_FILE)["services"]
    names = {"tokenizer": "grok-tokenizer", "model": "grok-model"}
    manifests = rendered["base"]
    for service in ("tokenizer", "model", "gateway"):
        expected = {k: re.sub(r"\b(tokenizer|model):(\d+)", lambda m: f"{names[m[1]]}:{m[2]}", str(v))
                    for k, v in compose[service]["environment"].items()}
        (pod, *_) = manifests.pods(manifests.get("Deployment", f"grok-{service}"))
        assert manifests.environment(pod) == expected, service


def test_rendered_environment_parses_with_each_services_own_flags(rendered: dict[str, Manifests],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for manifests in rendered.values():
        for pod in manifests.all_pods():
            env = manifests.environment(pod)
            with monkeypatch.context() as m:
                for key, value in env.items():
                    m.setenv(key, value)
                PARSERS[component(pod)]()  # argparse exits on a value its flag rejects


@pytest.fixture(scope="module")
def flag_variables() -> dict[str, set[str]]:
    """The GROK_* variables each service's `python -m ... --help` documents."""
    out = {}
    for name, module in (("tokenizer", "tokenizer_service"), ("model", "model_service"), ("gateway", "gateway")):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "COLUMNS": "1000"})
        assert done.returncode == 0, done.stderr
        out[name] = set(re.findall(r"\[env (GROK_[A-Z0-9_]+)\]", done.stdout))
    return out


def test_every_grok_variable_names_a_flag_of_its_service(rendered: dict[str, Manifests],
                                                         flag_variables: dict[str, set[str]]) -> None:
    for name, manifests in rendered.items():
        for pod in manifests.all_pods():
            prefix = f"GROK_{component(pod).upper()}_"
            variables = {k for k in manifests.environment(pod) if k.startswith(prefix)}
            assert variables - flag_variables[component(pod)] == set(), (name, pod.name)


def test_multi_process_variables_name_flags_of_the_model_service(rendered: dict[str, Manifests],
                                                                 flag_variables: dict[str, set[str]]) -> None:
    used = {k for m in rendered.values() for pod in m.all_pods() for k in m.environment(pod)}
    assert GROUP_VARIABLES <= used, "the group overlays no longer set the multi-process variables"
    assert GROUP_VARIABLES - flag_variables["model"] == set(), "python -m model_service --help lacks these"


def group(manifests: Manifests) -> tuple[dict, dict] | None:
    """The (leader, worker) StatefulSets of a multi-process model group, if the overlay has one."""
    sets = {s["metadata"]["labels"]["grok-serve.io/model-role"]: s for s in manifests.by_kind.get("StatefulSet", [])}
    return (sets["server"], sets["follower"]) if sets else None


def test_groups_name_the_coordinator_and_number_the_processes_by_pod_index(rendered: dict[str, Manifests]) -> None:
    groups = {name: group(m) for name, m in rendered.items() if group(m)}
    assert set(groups) == {"grok1-gpu-multihost", "grok1-tpu-multihost", "demo-multiprocess"}
    for name, (leader, worker) in groups.items():
        manifests = rendered[name]
        assert "grok-model" not in {d["metadata"]["name"] for d in manifests.by_kind["Deployment"]}
        # jax.distributed waits for every process, so none may wait for another to be ready first.
        assert leader["spec"]["podManagementPolicy"] == worker["spec"]["podManagementPolicy"] == "Parallel"
        assert leader["spec"]["replicas"] == 1 and worker["spec"]["ordinals"]["start"] == 1
        pods = manifests.pods(leader) + manifests.pods(worker)
        envs = [manifests.environment(pod) for pod in pods]
        assert [e["GROK_MODEL_PROCESS_ID"] for e in envs] == [str(i) for i in range(len(pods))]
        assert {e["GROK_MODEL_NUM_PROCESSES"] for e in envs} == {str(len(pods))}
        service = manifests.get("Service", leader["spec"]["serviceName"])
        assert worker["spec"]["serviceName"] == service["metadata"]["name"]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert {p.name for p in manifests.selected(service["spec"]["selector"])} == {p.name for p in pods}
        coordinator_port = next(p["containerPort"] for p in pods[0].container()["ports"] if p["name"] == "coordinator")
        assert {e["GROK_MODEL_COORDINATOR"] for e in envs} == {
            f"{pods[0].name}.{service['metadata']['name']}:{coordinator_port}"}


def test_group_leader_runs_the_single_host_replicas_container(rendered: dict[str, Manifests]) -> None:
    base = rendered["base"].pods(rendered["base"].get("Deployment", "grok-model"))[0]
    leader, worker = group(rendered["demo-multiprocess"])  # type: ignore[misc]
    same = ("command", "image", "envFrom", "startupProbe", "readinessProbe", "livenessProbe", "resources",
            "securityContext", "volumeMounts")
    for statefulset in (leader, worker):
        pod = rendered["demo-multiprocess"].pods(statefulset)[0]
        for key in same:
            if key.endswith("Probe") and statefulset is worker:
                continue
            expected = base.container()[key]
            if key == "envFrom":
                expected = [{"configMapRef": {"name": pod.container()[key][0]["configMapRef"]["name"]}}]
            assert pod.container()[key] == expected, (statefulset["metadata"]["name"], key)
        for key in ("securityContext", "volumes", "terminationGracePeriodSeconds", "automountServiceAccountToken"):
            assert pod.spec[key] == base.spec[key], key


def devices_per_pod(pod: Pod) -> int:
    """Accelerators a pod gets (the device plugin's resource), or the one CPU device JAX sees."""
    limits = pod.container()["resources"].get("limits", {})
    found = [int(limits[r]) for r in DEVICE_RESOURCES if r in limits]
    assert len(found) <= 1 and all(int(pod.container()["resources"]["requests"].get(r, limits[r])) == int(limits[r])
                                   for r in DEVICE_RESOURCES if r in limits), pod.name
    return found[0] if found else 1


def test_devices_of_each_replica_are_exactly_its_mesh(rendered: dict[str, Manifests]) -> None:
    for name, manifests in rendered.items():
        servers = [p for p in manifests.all_pods() if component(p) == "model" and not is_follower(p)]
        for server in servers:
            env = manifests.environment(server)
            data, model = (int(x) for x in env["GROK_MODEL_MESH"].split(","))
            processes = int(env.get("GROK_MODEL_NUM_PROCESSES", "1"))
            members = [p for p in manifests.all_pods() if component(p) == "model"] if processes > 1 else [server]
            assert len(members) == processes, name
            assert sum(devices_per_pod(p) for p in members) == data * model, (name, env["GROK_MODEL_MESH"])


def test_grok1_overlays_read_the_release_from_a_read_only_volume(rendered: dict[str, Manifests]) -> None:
    for name in ("grok1-gpu", "grok1-gpu-multihost", "grok1-tpu-multihost"):
        manifests = rendered[name]
        claims = {c["metadata"]["name"]: c for c in manifests.by_kind["PersistentVolumeClaim"]}
        assert claims["grok-weights"]["spec"]["accessModes"] == ["ReadOnlyMany"]
        assert claims["grok-compile-cache"]["spec"]["accessModes"] == ["ReadWriteMany"]
        for pod in manifests.all_pods():
            if component(pod) not in {"model", "tokenizer"}:
                continue
            env = manifests.environment(pod)
            volumes = {v["name"]: v for v in pod.spec["volumes"]}
            mounts = {m["mountPath"]: m for m in pod.container()["volumeMounts"]}
            weights = mounts["/models"]
            assert weights["readOnly"] is True and volumes[weights["name"]]["persistentVolumeClaim"] == {
                "claimName": "grok-weights", "readOnly": True}
            if component(pod) == "tokenizer":
                assert env["GROK_TOKENIZER_MODEL"] == "/models/tokenizer.model"
                continue
            assert env["GROK_MODEL_CONFIG"] == "grok-1" and env["GROK_MODEL_CHECKPOINT"] == "/models/checkpoints"
            cache = next(m for path, m in mounts.items() if env["GROK_MODEL_COMPILE_CACHE"].startswith(path + "/"))
            assert volumes[cache["name"]]["persistentVolumeClaim"]["claimName"] == "grok-compile-cache"
            assert env["JAX_PLATFORMS"] in {"cuda", "tpu"} and pod.container()["image"] != "grok-serve:latest"
