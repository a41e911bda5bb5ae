"""GrokModel: the Grok-1 network's pure, jit-able entry points for the serving engine.

prefill (one padded prompt -> last-position logits + a batch-1 KV prefix), insert (prefix -> batch slot),
decode (one token per slot, each at its own position), plus full-sequence `forward` for parity checks and
the sharding pytrees the engine jits with.
"""

from __future__ import annotations

import functools
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from model_service import kv_memory
from model_service.config import MeshConfig, ModelConfig, validate
from model_service.kv_memory import KVMemory, Memory
from model_service.model.layers import QuantizedWeight
from model_service.model.params import Params
from model_service.model.transformer import Step, forward
from model_service.sharding import DATA, MODEL, params_shardings

__all__ = ["GrokModel", "KVMemory", "Memory", "Params", "QuantizedWeight"]

Array = jax.Array


class GrokModel:
    """The network bound to a config, a mesh and a compute dtype (float32 or bfloat16)."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype) -> None:
        validate(cfg, MeshConfig(data=mesh.shape[DATA], model=mesh.shape[MODEL]))
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"compute dtype must be float32 or bfloat16, got {dtype}")
        self.cfg = cfg
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        self._net = hk.without_apply_rng(hk.transform(functools.partial(forward, cfg, mesh, self.dtype)))

    def init_memory(self, batch: int) -> Memory:
        """Empty KV memory: `batch` slots of sequence_len positions, all at position 0."""
        t = self.cfg.model
        return kv_memory.init_memory(batch, self.cfg.sequence_len, t.num_layers, t.num_kv_heads, t.key_size,
                                     self.dtype)

    def prefill(self, params: Params, tokens: Array, length: Array) -> tuple[Array, Memory]:
        """tokens [1, T] int32 padded after `length` -> (logits [1, V] float32 at length-1, batch-1 prefix)."""
        n = tokens.shape[1]
        if n > self.cfg.sequence_len:
            raise ValueError(f"prompt bucket {n} exceeds sequence_len {self.cfg.sequence_len}")
        length = jnp.clip(jnp.asarray(length, jnp.int32), 1, n)
        positions = jnp.arange(n, dtype=jnp.int32)[None, :]
        causal = jnp.tril(jnp.ones((n, n), bool))[None]
        mask = causal & (tokens != self.cfg.pad_token)[:, None, :]  # pad keys are masked, as the reference does
        step = Step(positions, mask, None, None)
        logits, caches = self._net.apply(params, tokens, step, jnp.reshape(length - 1, (1,)))
        return logits, Memory(caches, jnp.reshape(length, (1,)))

    def decode(self, params: Params, tokens: Array, memory: Memory,
               active: Array | None = None) -> tuple[Array, Memory]:
        """tokens [B] int32, one per slot -> (logits [B, V] float32, memory advanced by one per slot).

        `active` [B] bool marks the slots whose outputs are used; inactive slots never make an expert run
        (their logits are then meaningless), and active slots' results are the same either way.
        """
        s = memory.layers[0].k.shape[2]
        write = jnp.minimum(memory.positions, s - 1)  # a finished slot never writes out of bounds
        mask = (jnp.arange(s, dtype=jnp.int32)[None, :] <= write[:, None])[:, None, :]  # [B, 1, S]
        step = Step(write[:, None], mask, memory.layers, write, active)
        logits, caches = self._net.apply(params, tokens[:, None], step, jnp.zeros_like(write))
        return logits, Memory(caches, jnp.minimum(memory.positions + 1, s))

    def forward(self, params: Params, tokens: Array) -> Array:
        """Full pass without memory: tokens [B, T] -> logits [B, T, V] float32 (pad keys masked)."""
        n = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], tokens.shape)
        mask = jnp.tril(jnp.ones((n, n), bool))[None] & (tokens != self.cfg.pad_token)[:, None, :]
        logits, _ = self._net.apply(params, tokens, Step(positions, mask, None, None), None)
        return logits

    def insert(self, memory: Memory, prefix: Memory, slot: Array) -> Memory:
        """Copy a batch-1 prefill result into `slot` (resets that slot's position to the prompt length)."""
        return kv_memory.insert(memory, prefix, slot)

    def memory_shardings(self, batch: int) -> Memory:
        t = self.cfg.model
        return kv_memory.memory_shardings(self.mesh, batch, self.cfg.sequence_len, t.num_layers, t.num_kv_heads,
                                          t.key_size)

    def params_shardings(self, params: Params) -> Any:
        return params_shardings(params, self.mesh)

    def init_param_shapes(self) -> Any:
        """Shapes of haiku's own parameter tree for this network (reference layout), for layout checks."""
        n = 8
        step = Step(jnp.zeros((1, n), jnp.int32), jnp.ones((1, n, n), bool), None, None)
        return jax.eval_shape(lambda: self._net.init(jax.random.PRNGKey(0), jnp.zeros((1, n), jnp.int32),
                                                     step, None))
