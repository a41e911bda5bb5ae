"""From settings to a ready Engine: the server's configuration, its resolution, the weights, the Engine.

Below both model_service/server.py (process 0 / a single process) and model_service/distributed/group.py
(every process of a multi-process replica): both call `resolve`, then `load_engine`, then compile once —
`build_engine` on one process, or LockstepEngine.compile on a group (which compiles on every process in
lockstep). `load_engine` never compiles, so the programs are compiled exactly once per process.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from model_service.compile_lock import compiling_alone
from model_service.config import MeshConfig, ModelConfig, load_model_config, validate
from model_service.distributed.config import DistributedConfig
from model_service.pacing import DEFAULT_SLOWDOWN
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
    uds: str | None = None  # listen on this unix socket file instead of host:port (serving_common.uds)
    dtype: str = "float32"
    mesh: MeshConfig = MeshConfig()
    slots: int = 8  # the most sequences decoded at once
    kv_tokens: int | None = None  # KV pool size in tokens (None: slots full contexts)
    kv_memory: int | None = None  # or in bytes
    block_size: int = 16  # tokens per KV block
    prefix_caching: bool = True
    huge_pages: bool = True  # back the weights and the heap with transparent huge pages once compiled (host_memory)
    backend: str = "auto"  # auto | cpu | generic: the hardware choices (backend.py)
    moe: str = "auto"  # auto | pallas | ragged | cond: how the generic backend runs the experts (backend.choose_moe)
    layers: str = "auto"  # auto | scan | unroll: whether the generic backend scans its layers (Backend.scan_layers)
    attention: str = "auto"  # auto | batched | pallas: the generic backend's attention (backend.choose_attention)
    products: str = "auto"  # auto | native | xla: how token rows meet the weights on the cpu backend
    step_tokens: int | None = None  # token rows per step (None: engine.choose_shape's default for the platform)
    prefill_tokens: int | None = None  # prompt rows per step while others decode (None: paced, pacing.py)
    decode_slowdown: float = DEFAULT_SLOWDOWN  # a mixed step's time over a decode-only step's, at most (pacing.py)
    tile_rows: int | None = None  # rows per pass over the weights (None: the platform's default)
    speculative: Any = None  # speculative.SpeculativeConfig (None: off)
    max_queue: int = 64
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_uds: str | None = None  # /metrics on this unix socket file instead of metrics_host:metrics_port
    grace_seconds: float = 10.0
    random_seed: int = 0
    watchdog_seconds: float = 60.0  # 0 disables the decode-loop watchdog
    # Connections older than this get a GOAWAY so clients re-resolve and find new replicas (0: never).
    max_connection_age_seconds: float = 30.0
    max_connection_age_grace_seconds: float | None = None  # None: calls in flight are never cut
    tls: ServerTLS | None = None  # TLS, and mutual TLS when it names a client CA
    distributed: DistributedConfig | None = None  # set: this is process 0 (or a follower) of a multi-process replica
    tokenizer: str | None = None  # the model's SentencePiece file: enables structured output (constraints)
    engine_process: bool = False  # the Engine and the decode loop in a child process (engine_core.py)


def resolve(config: ServerConfig) -> ModelConfig:
    """The model config; raises ConfigError/ValueError with a clear message."""
    if not config.checkpoint and not config.random_init:
        raise ValueError("no --checkpoint given: pass --checkpoint DIR (containing ckpt-0/), or --random-init "
                         "to serve random weights deliberately")
    model_cfg = load_model_config(config.config)
    validate(model_cfg, config.mesh)
    if config.kv_tokens is not None and config.kv_memory is not None:
        raise ValueError("give the KV pool size once: --kv-tokens or --kv-memory, not both")
    return model_cfg


def build_engine(config: ServerConfig, cfg: ModelConfig) -> Any:
    """A single process's Engine: load (or randomly initialise) the weights, build the Engine, compile it (one
    process at a time per set of programs in a shared compilation cache: compile_lock.py)."""
    import jax

    engine = load_engine(config, cfg)
    with compiling_alone(jax.config.jax_compilation_cache_dir, programs_key(config, cfg)):
        compile_engine(engine)
    use_huge_pages(config, engine)
    return engine


def use_huge_pages(config: ServerConfig, engine: Any) -> None:
    """With --huge-pages on, back the Engine's weights and the heap with transparent huge pages (call it once the
    programs have run: their buffers are then in the heap)."""
    if not config.huge_pages:
        return
    from model_service.host_memory import huge_pages

    log.info("huge pages", extra=huge_pages(engine.params))


# The settings a process's programs depend on (beside the model config and JAX's own flags): two processes
# that agree on these compile the same programs.
PROGRAM_SETTINGS = ("dtype", "mesh", "slots", "kv_tokens", "kv_memory", "block_size", "prefix_caching", "backend", "moe",
                    "layers", "attention", "products", "step_tokens", "tile_rows", "speculative")


def programs_key(config: ServerConfig, cfg: ModelConfig) -> str:
    """Names the programs `config` compiles for `cfg` (equal keys: the same programs; compile_lock.py)."""
    settings = {name: getattr(config, name) for name in PROGRAM_SETTINGS}
    return repr((cfg, sorted(settings.items()), os.environ.get("XLA_FLAGS", "")))


def compile_engine(engine: Any) -> None:
    """Compile every program of `engine` (an Engine, or a LockstepEngine: then on every process)."""
    start = time.monotonic()
    timings = engine.compile()
    log.info("compiled all programs", extra={"seconds": round(time.monotonic() - start, 2), "programs": len(timings)})


def load_engine(config: ServerConfig, cfg: ModelConfig) -> Any:
    """Load (or randomly initialise) this process's weights onto the mesh and build the Engine, not compiled."""
    import jax  # heavy imports stay out of module import
    import jax.numpy as jnp

    from model_service import checkpoint
    from model_service.backend import attention_heads, choose_backend
    from model_service.engine import Engine
    from model_service.model import GrokModel
    from model_service.sharding import default_between_hosts, make_mesh

    between = None
    if config.distributed is not None:
        between = config.distributed.between_hosts or default_between_hosts(config.mesh, jax.process_count())
    mesh = make_mesh(config.mesh, between_hosts=between)
    read_before = _bytes_read()
    dtype = jnp.dtype(config.dtype)
    backend = choose_backend(config.backend, mesh, dtype, config.products, config.slots, config.step_tokens,
                             config.tile_rows, moe=config.moe, layers=config.layers, attention=config.attention,
                             block_size=config.block_size, heads=attention_heads(cfg))
    model = GrokModel(cfg, mesh, dtype, block_size=config.block_size, backend=backend)
    laid_out = model.load_options()  # laid out for the backend's operations as they load (GrokModel.pack_params')
    log.info("backend", extra={"backend": backend.name, "products": backend.products.value,
                               "attention": backend.attention, "tile_rows": backend.tile_rows,
                               "step_tokens": backend.step_tokens, "moe": backend.moe,
                               "scan_layers": backend.scan_layers})
    start = time.monotonic()
    if config.checkpoint:
        params = checkpoint.load_params(config.checkpoint, cfg, mesh, dtype, progress=_progress, **laid_out)
    else:
        log.warning("serving RANDOM weights (--random-init): outputs are noise")
        params = checkpoint.random_params(cfg, mesh, dtype, config.random_seed, **laid_out)
    log.info("weights ready", extra={"seconds": round(time.monotonic() - start, 2), "process_id": jax.process_index(),
                                     "bytes_read": _bytes_read() - read_before})
    blocks = kv_blocks(config, cfg, dtype.itemsize)
    log.info("kv memory", extra={"blocks": blocks, "block_size": config.block_size,
                                 "tokens": None if blocks is None else blocks * config.block_size})
    drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    return Engine(model, params, cfg, mesh, config.slots, blocks, draft_tokens=drafts)


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
