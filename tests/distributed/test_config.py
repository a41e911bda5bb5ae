"""The multi-process flags and environment variables, and how processes tile the mesh."""

from __future__ import annotations

import subprocess
import sys

import pytest

from model_service.__main__ import distributed_config, parser
from model_service.config import ConfigError, MeshConfig
from model_service.distributed import DistributedConfig
from model_service.sharding import default_between_hosts, local_mesh_shape
from tests.procs import GOLDEN, ROOT


def parse(argv: list[str]) -> DistributedConfig | None:
    return distributed_config(parser().parse_args(["--config", "grok-1", *argv]))


def test_group_settings_come_from_the_grok_model_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROK_MODEL_COORDINATOR", "model-0.model:8476")
    monkeypatch.setenv("GROK_MODEL_NUM_PROCESSES", "4")
    monkeypatch.setenv("GROK_MODEL_PROCESS_ID", "3")
    monkeypatch.setenv("GROK_MODEL_BETWEEN_HOSTS", "2,2")
    monkeypatch.setenv("GROK_MODEL_STEP_TIMEOUT", "12.5")
    config = parse([])
    assert config == DistributedConfig("model-0.model:8476", 4, 3, MeshConfig(2, 2), step_timeout=12.5)
    assert not config.is_leader
    assert parse(["--process-id", "0"]).is_leader  # the flag wins over the environment


def test_one_process_is_a_plain_replica() -> None:
    assert parse([]) is None


@pytest.mark.parametrize("argv, message", [
    (["--num-processes", "2"], "needs --coordinator"),
    (["--num-processes", "2", "--coordinator", "10.0.0.1"], "HOST:PORT"),
    (["--num-processes", "2", "--coordinator", "h:1", "--process-id", "2"], "0..1"),
    (["--num-processes", "2", "--coordinator", "h:1", "--process-id", "-1"], "0..1"),
    (["--coordinator", "h:1"], "need --num-processes >= 2"),
    (["--num-processes", "2", "--coordinator", "h:1", "--between-hosts", "2,2"], "4 blocks for 2 processes"),
    (["--num-processes", "2", "--coordinator", "h:1", "--engine-process"], "not supported together"),
])
def test_inconsistent_group_settings_are_refused_with_the_fix(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(argv)


def test_bad_group_settings_exit_2_before_joining_anything() -> None:
    done = subprocess.run([sys.executable, "-m", "model_service", "--config", str(GOLDEN / "config.json"),
                           "--random-init", "--num-processes", "2", "--coordinator", "nowhere"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--coordinator must be HOST:PORT" in done.stderr


def test_help_documents_the_group_flags_and_their_variables() -> None:
    done = subprocess.run([sys.executable, "-m", "model_service", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    text = " ".join(done.stdout.split())
    for flag in ("coordinator", "num-processes", "process-id", "between-hosts", "step-timeout", "startup-timeout"):
        assert f"--{flag}" in text and f"GROK_MODEL_{flag.replace('-', '_').upper()}" in text


def test_processes_go_on_the_data_axis_when_they_divide_it_else_on_the_model_axis() -> None:
    assert default_between_hosts(MeshConfig(1, 8), 2) == MeshConfig(1, 2)
    assert default_between_hosts(MeshConfig(2, 4), 2) == MeshConfig(2, 1)
    assert local_mesh_shape(MeshConfig(1, 8), MeshConfig(1, 2)) == MeshConfig(1, 4)
    with pytest.raises(ConfigError, match="divide neither axis"):
        default_between_hosts(MeshConfig(1, 8), 3)
    with pytest.raises(ConfigError, match="must divide the mesh"):
        local_mesh_shape(MeshConfig(1, 8), MeshConfig(2, 1))


class FakeDevice:
    def __init__(self, id: int, process_index: int, platform: str = "cpu") -> None:
        self.id, self.process_index, self.platform, self.device_kind = id, process_index, platform, "cpu"


def test_a_programs_device_key_is_the_same_on_every_process_of_a_cpu_group() -> None:
    """JAX hashes each process's own view of the CPU topology into a program's key; the shared key describes
    the program's devices alone, so process 1 finds the program process 0 sent."""
    import hashlib

    import numpy as np

    from model_service.distributed.config import _same_cpu_topology_everywhere

    views = []

    def per_process_view(hash_obj, devices):  # what JAX's own hash does: it differs per process
        hash_obj.update(str(len(views)).encode())

    for _ in range(2):
        h = hashlib.sha256()
        _same_cpu_topology_everywhere(per_process_view)(h, np.array([FakeDevice(i, i // 2) for i in range(4)]))
        views.append(h.hexdigest())
    assert views[0] == views[1]
    other = hashlib.sha256()
    _same_cpu_topology_everywhere(per_process_view)(other, np.array([FakeDevice(i, 0) for i in range(4)]))
    assert other.hexdigest() != views[0]  # other devices, another program
    gpu, fallback = hashlib.sha256(), hashlib.sha256()
    _same_cpu_topology_everywhere(per_process_view)(gpu, np.array([FakeDevice(0, 0, "gpu")]))
    per_process_view(fallback, None)
    assert gpu.hexdigest() == fallback.hexdigest()  # accelerators keep JAX's own key


def test_compiling_once_stays_off_unless_every_process_can(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A process that cannot take part (here process 1) turns it off for all: none waits for a program that
    process 0 would not send."""
    import jax
    from jax._src import distributed as jax_distributed

    from model_service.distributed.config import compile_once

    class Store:
        def __init__(self) -> None:
            self.values = {"grok_compile_once/1": "0"}

        def key_value_set(self, key: str, value: str) -> None:
            self.values[key] = value

        def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
            return self.values[key]

    store = Store()
    jax.devices()  # this process's backend, made before the group's client is faked
    monkeypatch.setattr(jax_distributed.global_state, "client", store)
    before = (jax.config.jax_share_binary_between_hosts, jax.config.jax_compilation_cache_dir)
    assert not compile_once(DistributedConfig("127.0.0.1:1", 2, 0), str(tmp_path / "programs"))
    assert store.values["grok_compile_once/0"] == "1"  # process 0 could
    assert (jax.config.jax_share_binary_between_hosts, jax.config.jax_compilation_cache_dir) == before
