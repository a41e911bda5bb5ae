"""How a model service process takes part in a multi-process replica: agree on the settings, then either
serve (process 0, with a LockstepEngine) or follow (every other process)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from model_service.config import ConfigError, ModelConfig, model_config_to_dict
from model_service.distributed.config import DistributedConfig
from model_service.distributed.follower import Watchdog, follow, stop_on_sigterm
from model_service.distributed.link import FollowerLink, KeyValue, LeaderLink, connect_follower, open_leader
from model_service.distributed.lockstep import Channel, LockstepEngine
from model_service.distributed.ops import Replica, codec_for
from model_service.loading import ServerConfig, compile_engine, load_engine, resolve, use_huge_pages

log = logging.getLogger(__name__)


def fingerprint(config: ServerConfig, model_cfg: ModelConfig) -> np.ndarray:
    """[8] int32 digest of everything that must be equal on every process for the programs to match."""
    dist = config.distributed
    settings: dict[str, Any] = {
        "model": model_config_to_dict(model_cfg), "dtype": config.dtype, "mesh": [config.mesh.data, config.mesh.expert, config.mesh.model],
        "between_hosts": [dist.between_hosts.data, dist.between_hosts.model] if dist and dist.between_hosts else None,
        "slots": config.slots, "step_tokens": config.step_tokens, "tile_rows": config.tile_rows,
        "kv": [config.kv_tokens, config.kv_memory, config.block_size], "speculative": repr(config.speculative),
        "weights": "checkpoint" if config.checkpoint else f"random:{config.random_seed}"}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).digest()
    return np.frombuffer(digest, "<i4").copy()


def verify_same_config(config: ServerConfig, model_cfg: ModelConfig) -> None:
    """Raise ConfigError on every process unless all were started with the same model settings."""
    from jax.experimental import multihost_utils

    try:
        multihost_utils.assert_equal(fingerprint(config, model_cfg), "settings differ")
    except AssertionError:
        raise ConfigError("the processes of this group were started with different model settings (config, dtype, "
                          "mesh, between-hosts, slots, step shape, KV pool or weights): start every process with the same "
                          "GROK_MODEL_* values") from None


def leader_engine(config: ServerConfig, model_cfg: ModelConfig, on_broken: Callable[[str], None]) -> LockstepEngine:
    """Process 0's engine: load this process's shards, then compile everywhere in lockstep (once)."""
    dist = _dist(config)
    verify_same_config(config, model_cfg)
    channel = leader_channel(dist)
    inner = load_engine(config, model_cfg)
    engine = LockstepEngine(inner, channel, dist.step_timeout, dist.startup_timeout, dist.keepalive_seconds,
                            on_broken)
    compile_engine(engine)
    use_huge_pages(config, inner)
    return engine


def run_follower(config: ServerConfig) -> int:
    """A follower's whole life: load, then replay process 0's calls (the first compiles); its exit code."""
    dist = _dist(config)
    stop_on_sigterm(config.grace_seconds)
    model_cfg = resolve(config)
    watchdog = Watchdog()
    watchdog.arm(dist.startup_timeout, "loading the weights")
    verify_same_config(config, model_cfg)
    channel = follower_channel(dist)
    engine = load_engine(config, model_cfg)
    use_huge_pages(config, engine)  # the weights now; its programs' buffers come with the first call
    log.info("weights loaded; waiting for process 0", extra={"process_id": dist.process_id})
    return follow(Replica(engine), channel, codec_for(engine), dist, watchdog)


# Every process has just passed verify_same_config together, so the followers connect at once.
CONNECT_SECONDS = 300.0


def leader_channel(dist: DistributedConfig) -> Channel:
    """Process 0's end of the lockstep link (link.py), once every follower has connected."""
    link: LeaderLink = open_leader(_store(), dist.coordinator, dist.num_processes,
                                   min(CONNECT_SECONDS, dist.startup_timeout))
    return link


def follower_channel(dist: DistributedConfig) -> Channel:
    link: FollowerLink = connect_follower(_store(), dist.coordinator, dist.process_id,
                                          min(CONNECT_SECONDS, dist.startup_timeout))
    return link


def _store() -> KeyValue:
    """jax.distributed's coordination service, which every process of the group has joined."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: join the group first (distributed.initialize)")
    store: KeyValue = client
    return store


def _dist(config: ServerConfig) -> DistributedConfig:
    if config.distributed is None:
        raise ValueError("not a multi-process configuration")
    return config.distributed
