"""Every Grok-1 layout in deploy/ (the Kubernetes overlays and docker-compose.grok1.yml) fits its devices by the
placement tool, on a mesh the service runs today; docs/deploy.md's table of Grok-1 layouts is the tool's output."""

from __future__ import annotations

import subprocess
import sys

import pytest

from model_service.config import load_model_config
from model_service.placement import Devices, Layout, Placement, Workload, place
from tests.deploy.compose import COMPOSE_FILE, GROK1_FILE, resolved_config
from tests.deploy.k8s import OVERLAYS, Manifests, Pod, render
from tests.procs import ROOT

# The accelerator a pod gets: GKE's TPU node selector names the chip; the GPU overlays are written for 80 GB GPUs.
TPU_KINDS = {"tpu-v5p-slice": "v5p", "tpu-v5-lite-podslice": "v5e", "tpu-v6e-slice": "v6e"}
DEVICE_RESOURCES = ("nvidia.com/gpu", "google.com/tpu")


def placement_of(env: dict[str, str], kind: str, count: int) -> Placement:
    """The placement tool's answer for a model service configured by `env` on `count` devices of `kind`."""
    cfg = load_model_config(env["GROK_MODEL_CONFIG"])
    kv_tokens = int(env["GROK_MODEL_KV_TOKENS"]) if "GROK_MODEL_KV_TOKENS" in env else None
    work = Workload(env.get("GROK_MODEL_DTYPE", "float32"), int(env.get("GROK_MODEL_SLOTS", "8")), kv_tokens)
    return place(cfg, Devices.parse(f"{kind}-{count}"), Layout.parse(env["GROK_MODEL_MESH"]), work)


def pod_devices(pod: Pod) -> tuple[str, int]:
    limits = pod.container()["resources"].get("limits", {})
    count = sum(int(limits[r]) for r in DEVICE_RESOURCES if r in limits)
    if "google.com/tpu" in limits:
        return TPU_KINDS[pod.spec["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"]], count
    return "h100", count


def k8s_grok1_layouts() -> dict[str, Placement]:
    found = {}
    for overlay in OVERLAYS:
        manifests = Manifests(render(overlay))
        models = [p for p in manifests.all_pods() if p.labels["app.kubernetes.io/component"] == "model"]
        for server in (p for p in models if p.labels.get("grok-serve.io/model-role", "server") == "server"):
            env = manifests.environment(server)
            if env.get("GROK_MODEL_CONFIG") != "grok-1":
                continue
            members = models if int(env.get("GROK_MODEL_NUM_PROCESSES", "1")) > 1 else [server]
            kinds = {pod_devices(p)[0] for p in members}
            assert len(kinds) == 1, (overlay.name, kinds)
            found[overlay.name] = placement_of(env, kinds.pop(), sum(pod_devices(p)[1] for p in members))
    return found


def test_every_grok1_kubernetes_overlay_fits_its_devices_on_a_mesh_that_runs_today() -> None:
    layouts = k8s_grok1_layouts()
    assert set(layouts) == {"grok1-gpu", "grok1-gpu-multihost", "grok1-tpu-multihost"}
    for name, p in layouts.items():
        assert p.fits and p.runs_today, (name, p.reason())
        assert p.layout.size == p.devices.count, name
        assert p.max_sequences >= 8, name  # the pool of 8 full contexts, with room to spare


def test_the_gpu_multihost_overlays_48_gb_gpus_fit_too() -> None:
    """Its comment says 80 GB or 48 GB GPUs: the 48 GB ones hold the same layout."""
    assert "48 GB" in (ROOT / "deploy/k8s/overlays/grok1-gpu-multihost/kustomization.yaml").read_text()
    server = next(p for name, p in k8s_grok1_layouts().items() if name == "grok1-gpu-multihost")
    work = Workload("bfloat16", 8)
    assert place(load_model_config("grok-1"), Devices("gpu", 8, 48 * 10**9), server.layout, work).fits


def test_grok1_compose_file_fits_its_gpus() -> None:
    model = resolved_config(COMPOSE_FILE, GROK1_FILE)["services"]["model"]
    count = sum(d["count"] for d in model["deploy"]["resources"]["reservations"]["devices"])
    p = placement_of(model["environment"], "h100", count)
    assert p.fits and p.runs_today and p.layout.size == count, p.reason()


def test_a_grok1_layout_that_does_not_fit_fails_this_check() -> None:
    env = {"GROK_MODEL_CONFIG": "grok-1", "GROK_MODEL_DTYPE": "bfloat16", "GROK_MODEL_SLOTS": "8",
           "GROK_MODEL_MESH": "1,8"}
    assert not placement_of(env, "v5e", 8).fits


def test_docs_grok1_layouts_are_the_placement_tools_output() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "deploy_layouts.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("claim", ["split over both", "the KV memory is split over both"])
def test_docs_no_longer_claim_the_kv_pool_is_split_over_the_data_axis(claim: str) -> None:
    assert claim not in (ROOT / "docs" / "deploy.md").read_text()
