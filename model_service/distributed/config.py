"""The multi-process settings of one model replica and joining the group with jax.distributed."""

from __future__ import annotations

import logging
from dataclasses import dataclass

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
