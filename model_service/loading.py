"""From settings to a ready Engine: the server's configuration, its resolution, the weights, the Engine.

Below both model_service/server.py (process 0 / a single process) and model_service/distributed/group.py
(every process of a multi-process replica): both call `resolve`, then `load_engine`, then compile once —
`build_engine` on one process, or LockstepEngine.compile_all on a group (which compiles on every process in
lockstep). `load_engine` never compiles, so the programs are compiled exactly once per process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from model_service.config import MeshConfig, ModelConfig, load_model_config, validate
from model_service.distributed.config import DistributedConfig
from serving_common.tls import ServerTLS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Everything `python -m model_service` is configured with (parsed once in __main__)."""

    config: str
    checkpoint: str | None
    random_init: bool = False
    host: str = "127.0.0.1"
    port: int = 50053
    dtype: str = "float32"
    mesh: MeshConfig = MeshConfig()
    slots: int = 8  # the most sequences decoded at once
    kv_tokens: int | None = None  # KV pool size in tokens (None: slots full contexts)
    kv_memory: int | None = None  # or in bytes
    block_size: int = 16  # tokens per KV block
    prefix_caching: bool = True
    row_tile: int | None = None  # decode rows per tile; None: the engine's choice for the platform
    products: str = "auto"  # auto | native | xla: how token rows meet the weights (model.choose_products)
    prefill_chunk: int = 64  # longer prompts are prefilled this many tokens per decode step; 0: at once
    buckets: tuple[int, ...] | None = None  # None: powers of two from 32 up to the context
    max_queue: int = 64
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    grace_seconds: float = 10.0
    random_seed: int = 0
    watchdog_seconds: float = 60.0  # 0 disables the decode-loop watchdog
    # Connections older than this get a GOAWAY so clients re-resolve and find new replicas (0: never).
    max_connection_age_seconds: float = 30.0
    max_connection_age_grace_seconds: float | None = None  # None: calls in flight are never cut
    tls: ServerTLS | None = None  # TLS, and mutual TLS when it names a client CA
    distributed: DistributedConfig | None = None  # set: this is process 0 (or a follower) of a multi-process replica
    tokenizer: str | None = None  # the model's SentencePiece file: enables structured output (constraints)


def default_buckets(sequence_len: int) -> tuple[int, ...]:
    """32, 64, ... up to 1024, capped at (and always including a bucket that reaches) the context."""
    out, b = [], 32
    while b < min(sequence_len, 1024):
        out.append(b)
        b *= 2
    out.append(min(b, sequence_len))
    return tuple(out)


def resolve(config: ServerConfig) -> tuple[ModelConfig, tuple[int, ...]]:
    """The model config and the prefill buckets; raises ConfigError/ValueError with a clear message."""
    if not config.checkpoint and not config.random_init:
        raise ValueError("no --checkpoint given: pass --checkpoint DIR (containing ckpt-0/), or --random-init "
                         "to serve random weights deliberately")
    model_cfg = load_model_config(config.config)
    validate(model_cfg, config.mesh)
    if config.kv_tokens is not None and config.kv_memory is not None:
        raise ValueError("give the KV pool size once: --kv-tokens or --kv-memory, not both")
    if config.prefill_chunk % config.block_size:
        raise ValueError(f"--prefill-chunk ({config.prefill_chunk}) must be a multiple of --block-size "
                         f"({config.block_size})")
    if config.row_tile and config.slots % min(config.row_tile, config.slots):
        raise ValueError(f"--slots ({config.slots}) must be a multiple of --row-tile ({config.row_tile})")
    buckets = config.buckets or default_buckets(model_cfg.sequence_len)
    return model_cfg, buckets


def build_engine(config: ServerConfig, cfg: ModelConfig, buckets: tuple[int, ...]) -> Any:
    """A single process's Engine: load (or randomly initialise) the weights, build the Engine, compile it."""
    engine = load_engine(config, cfg, buckets)
    compile_engine(engine)
    return engine


def compile_engine(engine: Any) -> None:
    """Compile every program of `engine` (an Engine, or a LockstepEngine: then on every process)."""
    start = time.monotonic()
    timings = engine.compile_all()
    log.info("compiled all programs", extra={"seconds": round(time.monotonic() - start, 2), "programs": len(timings)})


def load_engine(config: ServerConfig, cfg: ModelConfig, buckets: tuple[int, ...]) -> Any:
    """Load (or randomly initialise) this process's weights onto the mesh and build the Engine, not compiled."""
    import jax  # heavy imports stay out of module import
    import jax.numpy as jnp

    from model_service import checkpoint
    from model_service.engine import Engine
    from model_service.model import GrokModel, Products, choose_products
    from model_service.sharding import default_between_hosts, make_mesh

    between = None
    if config.distributed is not None:
        between = config.distributed.between_hosts or default_between_hosts(config.mesh, jax.process_count())
    mesh = make_mesh(config.mesh, between_hosts=between)
    read_before = _bytes_read()
    dtype = jnp.dtype(config.dtype)
    model = GrokModel(cfg, mesh, dtype, choose_products(config.products, mesh, dtype), block_size=config.block_size)
    pack = model.products is Products.NATIVE  # matrices packed for the kernel as they load
    log.info("products", extra={"requested": config.products, "using": model.products.value})
    start = time.monotonic()
    if config.checkpoint:
        params = checkpoint.load_params(config.checkpoint, cfg, mesh, dtype, progress=_progress, pack=pack)
    else:
        log.warning("serving RANDOM weights (--random-init): outputs are noise")
        params = checkpoint.random_params(cfg, mesh, dtype, config.random_seed, pack=pack)
    log.info("weights ready", extra={"seconds": round(time.monotonic() - start, 2), "process_id": jax.process_index(),
                                     "bytes_read": _bytes_read() - read_before})
    blocks = kv_blocks(config, cfg, dtype.itemsize)
    log.info("kv memory", extra={"blocks": blocks, "block_size": config.block_size,
                                 "tokens": None if blocks is None else blocks * config.block_size})
    return Engine(model, params, cfg, mesh, config.slots, buckets, config.row_tile, config.prefill_chunk,
                  kv_blocks=blocks, prefix_caching=config.prefix_caching)


def kv_blocks(config: ServerConfig, cfg: ModelConfig, itemsize: int) -> int | None:
    """The pool's blocks from --kv-tokens or --kv-memory (None: the engine's default, every slot a full context)."""
    if config.kv_tokens is not None:
        return -(-config.kv_tokens // config.block_size)
    if config.kv_memory is not None:
        t = cfg.model
        per_token = t.num_layers * 2 * t.num_kv_heads * t.key_size * itemsize  # keys and values, every layer
        return config.kv_memory // (per_token * config.block_size)
    return None


def _bytes_read() -> int:
    """Bytes this process has read through read()/pread() so far (Linux /proc/self/io `rchar`; 0 elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _progress(done: int, total: int) -> None:
    if done == total or done % max(1, total // 10) == 0:
        log.info("loading weights", extra={"done": done, "total": total})
