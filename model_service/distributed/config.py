"""The multi-process settings of one model replica and joining the group with jax.distributed."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from model_service.config import ConfigError, MeshConfig

log = logging.getLogger(__name__)

EXIT_GROUP_BROKEN = 75  # EX_TEMPFAIL: the group lost a process; restart every process of the group


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins its replica's group (parsed once in __main__, never changed)."""

    coordinator: str  # HOST:PORT of process 0's coordination service; process 0 binds exactly this address
    num_processes: int
    process_id: int
    between_hosts: MeshConfig | None = None  # how processes tile the mesh; None: sharding.default_between_hosts
    step_timeout: float = 60.0  # longest one lockstep engine call may take before the group counts as broken
    startup_timeout: float = 3600.0  # longest every process may take to load its weights and compile

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def keepalive_seconds(self) -> float:
        """Process 0 sends a no-op after this much idle time, so a lost process is noticed without traffic."""
        return min(2.0, self.step_timeout / 5)

    @property
    def follower_wait(self) -> float:
        """Longest a follower waits for process 0's next call (keep-alives arrive well within it)."""
        return self.step_timeout + 2 * self.keepalive_seconds

    @property
    def heartbeat_timeout(self) -> int:
        """jax.distributed's own dead-peer detection ends a process abruptly (fate sharing); keep it well
        behind ours, which reports NOT_SERVING and fails in-flight streams first."""
        return int(max(100.0, 2 * self.step_timeout + 30))

    def validate(self) -> None:
        if self.num_processes < 2:
            raise ConfigError("--num-processes must be >= 2 for a multi-process replica")
        if not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"--process-id must be in 0..{self.num_processes - 1}, got {self.process_id}")
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--coordinator must be HOST:PORT (process 0's address), got {self.coordinator!r}")
        if self.step_timeout <= 0 or self.startup_timeout <= 0:
            raise ConfigError("--step-timeout and --startup-timeout must be positive seconds")
        if self.between_hosts is not None and self.between_hosts.size != self.num_processes:
            raise ConfigError(f"--between-hosts {self.between_hosts.data},{self.between_hosts.model} has "
                              f"{self.between_hosts.size} blocks for {self.num_processes} processes")


def initialize(config: DistributedConfig) -> None:
    """Join the group: process 0 starts the coordination service on `coordinator`, everyone connects.

    Blocks until all `num_processes` processes have joined (jax.distributed's default 300 s, then raises).
    Must run before anything creates a JAX backend.
    """
    import jax

    log.info("joining the process group", extra={"coordinator": config.coordinator, "process_id": config.process_id,
                                                   "num_processes": config.num_processes})
    jax.distributed.initialize(
        coordinator_address=config.coordinator, num_processes=config.num_processes, process_id=config.process_id,
        coordinator_bind_address=config.coordinator if config.is_leader else None,
        heartbeat_timeout_seconds=config.heartbeat_timeout)
    log.info("joined the process group", extra={"process_id": jax.process_index(), "devices": jax.device_count(),
                                                 "local_devices": jax.local_device_count()})
    compile_once(config)


# A program that spans the group is compiled by process 0 alone and sent to the others through the coordination
# service (JAX's share_binary_between_hosts), instead of every process compiling the same program. JAX finds a
# shared program by its persistent-cache key, so the cache is switched on with a path that is the same string on
# every process and a threshold no compile reaches (nothing is written there), and on CPU the key's device part is
# made the same on every process: JAX hashes each process's own view of the CPU topology into it.
SHARED_PROGRAMS_DIR = "/tmp/grok-model-group-programs"
NEVER_WRITTEN_SECONDS = 1e9


def compile_once(config: DistributedConfig, directory: str = SHARED_PROGRAMS_DIR) -> bool:
    """Let process 0 compile the group's programs for every process (CPU backends; others keep JAX's default).
    Every process says whether it can; it is switched on only if all can, so no process waits for a program
    that process 0 never sends. Returns whether it is on."""
    import os

    import jax
    from jax._src import cache_key
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        return False
    able = jax.default_backend() == "cpu" and hasattr(cache_key, "_hash_accelerator_config")
    if able:
        try:
            os.makedirs(directory, exist_ok=True)
            able = os.access(directory, os.W_OK)
        except OSError:
            able = False
    client.key_value_set(f"grok_compile_once/{config.process_id}", "1" if able else "0")
    everyone = all(client.blocking_key_value_get(f"grok_compile_once/{i}", 300_000) == "1"
                   for i in range(config.num_processes))
    if everyone:
        cache_key._hash_accelerator_config = _same_cpu_topology_everywhere(cache_key._hash_accelerator_config)
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", NEVER_WRITTEN_SECONDS)
        jax.config.update("jax_share_binary_between_hosts", True)
        # a follower waits for each program as long as the group may take to start (JAX's default: 20 minutes)
        jax.config.update("jax_share_binary_between_hosts_timeout_ms", int(config.startup_timeout * 1000))
    log.info("programs compiled once for the group" if everyone else "every process compiles the group's programs",
             extra={"process_id": config.process_id})
    return everyone


def _same_cpu_topology_everywhere(hash_topology: Any) -> Any:
    """JAX's device part of a program's cache key, with CPU devices described by what every process sees alike."""
    def hash_devices(hash_obj: Any, devices: Any) -> None:
        flat = list(devices.flat)
        if flat and all(d.platform == "cpu" for d in flat):
            hash_obj.update(repr([(d.id, d.process_index, d.device_kind) for d in flat]).encode())
        else:
            hash_topology(hash_obj, devices)
    return hash_devices
