"""GrokModel: the Grok-1 network's pure, jit-able entry points for the serving engine.

prefill (padded prompts -> last-position logits + a KV prefix per prompt), insert (one prefix row -> a batch
slot), decode (one token for each of the first R slots, each at its own position), plus full-sequence `forward`
for parity checks and the sharding pytrees the engine jits with.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from model_service import kv_memory
from model_service.config import MeshConfig, ModelConfig, validate
from model_service.kv_memory import KVMemory, Memory
from model_service.model.layers import Products, QuantizedWeight
from model_service.model.packed import native_ok
from model_service.model.params import Params, pack_for_native, packable
from model_service.model.transformer import Step, forward, prompt_logprobs
from model_service.sharding import DATA, MODEL, params_shardings

__all__ = ["GrokModel", "KVMemory", "Memory", "Params", "Products", "QuantizedWeight", "choose_products"]

Array = jax.Array
PRODUCT_CHOICES = ("auto", "native", "xla")
BLOCK_SIZE = 16  # positions per KV block
KEY_CHUNK = 128  # key positions per attention chunk (a multiple of the block size)



def default_products(mesh: Mesh) -> Products:
    """XLA's products: fused multiply-reduce on CPU (faster there at decode sizes); dot_general elsewhere, where
    the vendor matrix kernels are the fast path."""
    return Products.FUSED_REDUCE if mesh.devices.flat[0].platform == "cpu" else Products.DOT


def choose_products(choice: str, mesh: Mesh, dtype: Any) -> Products:
    """--products: "xla" (XLA's forms), "native" (the native CPU kernel; an error where it cannot run) or "auto"
    (native on CPU in float32 where the kernel loaded and the replica is one process; XLA's forms elsewhere:
    GPUs/TPUs keep their dots)."""
    if choice not in PRODUCT_CHOICES:
        raise ValueError(f"products must be one of {', '.join(PRODUCT_CHOICES)}, got {choice!r}")
    if choice == "xla":
        return default_products(mesh)
    cpu = mesh.devices.flat[0].platform == "cpu"
    # A replica spanning processes keeps XLA's forms under auto: packing reads each whole matrix in every
    # process, where XLA's layouts let each process read only the shards its devices hold.
    if cpu and native_ok(dtype) and (choice == "native" or jax.process_count() == 1):
        return Products.NATIVE
    if choice == "native":
        raise ValueError("--products native needs the CPU platform, --dtype float32 and the native kernels built "
                         "(pip install -e . compiles them; the log says why they did not load): use --products xla")
    return default_products(mesh)


class GrokModel:
    """The network bound to a config, a mesh and a compute dtype (float32 or bfloat16).

    `products` picks how token rows meet weights (layers.Products; default: choose_products("auto")). With
    Products.NATIVE the expert matrices must be packed (pack_params, or checkpoint.load_params(products=...)).
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, products: Products | None = None,
                 block_size: int = BLOCK_SIZE, key_chunk: int = KEY_CHUNK) -> None:
        validate(cfg, MeshConfig(data=mesh.shape[DATA], model=mesh.shape[MODEL]))
        if block_size < 1 or block_size & (block_size - 1) or key_chunk % block_size:
            raise ValueError(f"the KV block size must be a power of two dividing {key_chunk}, got {block_size}")
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"compute dtype must be float32 or bfloat16, got {dtype}")
        self.cfg = cfg
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        self.products = products or choose_products("auto", mesh, self.dtype)
        # The sampler's nucleus threshold comes from the native kernel too where products are native on one
        # device (sampling.sample_tokens(native=True)); under a mesh the logits are sharded, XLA's search runs.
        self.native_sampling = self.products is Products.NATIVE and mesh.size == 1
        self.block_size = block_size
        # Keys are read in chunks of key_chunk positions, only as many as the longest sequence in a step holds.
        self.key_chunk = min(key_chunk, -(-cfg.sequence_len // block_size) * block_size)
        self.table_len = -(-cfg.sequence_len // self.key_chunk) * self.key_chunk // block_size  # entries per slot
        self._net = hk.without_apply_rng(hk.transform(functools.partial(forward, cfg, mesh, self.dtype)))
        self._scorer = hk.without_apply_rng(hk.transform(functools.partial(prompt_logprobs, cfg, mesh, self.dtype)))

    def pack_params(self, params: Params) -> Params:
        """With native products: the same tree with its packable leaves (params.packable) packed for the kernel,
        each a packed copy placed like a loaded one; packed trees come back as they are. Otherwise `params`."""
        if self.products is not Products.NATIVE:
            return params
        out: Params = {}
        for module, leaves in params.items():
            out[module] = dict(leaves)
            for name, leaf in leaves.items():
                if packable(module, leaf):
                    host = {module: {name: pack_for_native(module, jax.tree.map(np.asarray, leaf), self.mesh)}}
                    out[module][name] = jax.device_put(host, params_shardings(host, self.mesh))[module][name]
        return out

    def init_memory(self, slots: int, num_blocks: int | None = None) -> Memory:
        """Empty paged memory: a pool of `num_blocks` blocks (default: a full context for every slot, as
        `dense_tables` lays them out) and `slots` positions at 0."""
        t = self.cfg.model
        blocks = num_blocks if num_blocks is not None else slots * self.blocks_per_sequence
        return kv_memory.init_memory(slots, blocks, self.block_size, t.num_layers, t.num_kv_heads, t.key_size,
                                     self.dtype)

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks that hold a full context."""
        return -(-self.cfg.sequence_len // self.block_size)

    def dense_tables(self, slots: int) -> np.ndarray:
        """[slots, table_len] int32: slot i owns blocks i * blocks_per_sequence onward (a pool from init_memory's
        default), entries past a full context point at the scratch block. For tests and tools without a
        block manager."""
        per = self.blocks_per_sequence
        tables = np.full((slots, self.table_len), slots * per, np.int32)
        tables[:, :per] = np.arange(slots * per, dtype=np.int32).reshape(slots, per)
        return tables

    def prefill(self, params: Params, tokens: Array, length: Array) -> tuple[Array, Memory]:
        """tokens [N, T] int32, each row padded after its `length` [N] -> (logits [N, V] float32 at each row's
        length-1, a prefix Memory of N rows).

        The prompts run one after another through the same computation, so a prompt's bits never depend on the
        others in the call (kernels are picked by shape, and even a row's position in a batch moves its bits)."""
        b, n = tokens.shape
        if n > self.cfg.sequence_len:
            raise ValueError(f"prompt bucket {n} exceeds sequence_len {self.cfg.sequence_len}")
        length = jnp.clip(jnp.broadcast_to(jnp.asarray(length, jnp.int32), (b,)), 1, n)
        if b == 1:
            return self._prefill_one(params, tokens, length)
        logits, caches = jax.lax.map(lambda a: self._prefill_one(params, a[0][None], a[1][None]), (tokens, length))
        return logits[:, 0], Memory(jax.tree.map(lambda c: c[:, 0], caches.layers), length)

    def _prefill_one(self, params: Params, tokens: Array, length: Array) -> tuple[Array, Memory]:
        n = tokens.shape[1]
        positions = jnp.arange(n, dtype=jnp.int32)[None, :]
        causal = jnp.tril(jnp.ones((n, n), bool))[None]
        mask = causal & (tokens != self.cfg.pad_token)[:, None, :]  # pad keys are masked, as the reference does
        step = Step(positions, mask, None, None, products=self.products)
        logits, caches = self._net.apply(params, tokens, step, length - 1)
        return logits, Memory(caches, length)

    def decode(self, params: Params, tokens: Array, memory: Memory, tables: Array | None = None,
               active: Array | None = None, tile: int | None = None,
               tiles_to_run: Array | None = None) -> tuple[Array, Memory]:
        """tokens [R] int32 for the first R slots of `memory` (R <= its slots) -> (logits [R, V] float32, memory
        with those R slots advanced by one; the other slots untouched).

        `tables` [R or more, table_len] are the slots' block tables (default: dense_tables); each active row reads
        keys only from the chunks its own sequence fills (layers.paged_attention_rows). The rows run in tiles of
        `tile` (default R) rows, one after another, each through the same computation: a row's bits depend
        only on the tile size, never on how many tiles or key chunks run or what the other rows hold (batch
        invariance by construction), while one tile streams each weight once for all its rows. `active` [R] bool marks the slots whose outputs are used;
        inactive slots write nothing, never make an expert run, and with native products are not computed at
        all (their logits are then zero; with XLA's products, meaningless).
        `tiles_to_run` [] int32 (traced) runs only the first tiles (the rest of the rows get zero logits and
        keep their memory): idle tiles then cost nothing, with one compiled program for any number of requests.
        """
        r = tokens.shape[0]
        tile = tile or r
        if r > memory.positions.shape[0] or r % tile:
            raise ValueError(f"decode of {r} rows in tiles of {tile} over a memory of {memory.positions.shape[0]} slots")
        if tables is None:
            tables = self.dense_tables(memory.positions.shape[0])
        tables = jnp.asarray(tables)
        if active is None:
            active = jnp.ones((r,), bool)
        if r == tile and tiles_to_run is None:
            return self._decode_tile(params, tokens, memory, tables[:r], active, 0)
        logits = jnp.zeros((r, self.cfg.vocab_size), jnp.float32)
        # Tiles are unrolled (each with static row offsets) rather than looped: XLA-CPU runs a while loop's body
        # without intra-op parallelism, which made a looped tile ~2.5x slower than the same tile unrolled.
        for t in range(r // tile):
            rows = slice(t * tile, (t + 1) * tile)

            def run(carry: tuple[Array, Memory], rows: slice = rows) -> tuple[Array, Memory]:
                out, mem = self._decode_tile(params, tokens[rows], carry[1], tables[rows], active[rows], rows.start)
                return carry[0].at[rows].set(out), mem

            if tiles_to_run is None or t == 0:
                logits, memory = run((logits, memory))
            else:
                logits, memory = jax.lax.cond(t < tiles_to_run, run, lambda carry: carry, (logits, memory))
        return logits, memory

    def extend(self, params: Params, tokens: Array, memory: Memory, table: Array, slot: Array, start: Array,
               last: Array) -> tuple[Array, Memory]:
        """A prefill chunk: tokens [1, C] (C a multiple of the block size) at positions start .. start + C - 1 of
        `slot` (start a multiple of C), written into the blocks its `table` [table_len] lists there, attending
        to what those blocks hold before `start` (the prompt's earlier chunks, or a cached prefix). Returns
        logits [1, V] at chunk row `last` and the memory with the slot's position at start + last + 1."""
        c, bs = tokens.shape[1], self.block_size
        positions = (start + jnp.arange(c, dtype=jnp.int32))[None, :]  # [1, C]; causal: each sees keys up to itself
        blocks = jax.lax.dynamic_slice_in_dim(table, start // bs, c // bs)
        step = Step(positions, None, memory.layers, blocks, None, self.products, slot, None, table[None], positions,
                    self.key_chunk)
        logits, caches = self._net.apply(params, tokens, step, jnp.reshape(last, (1,)))
        return logits, Memory(caches, memory.positions.at[slot].set(start + last + 1))

    def _decode_tile(self, params: Params, tokens: Array, memory: Memory, tables: Array, active: Array,
                     start: Array | int) -> tuple[Array, Memory]:
        """One tile: tokens/active [T] and tables [T, table_len] for memory slots start .. start + T - 1."""
        t, s, bs = tokens.shape[0], self.cfg.sequence_len, self.block_size
        scratch = memory.layers[0].k.shape[0] - 1
        positions = jax.lax.dynamic_slice_in_dim(memory.positions, start, t)
        write = jnp.minimum(positions, s - 1)  # a finished slot never writes past the context
        index = jnp.minimum(write // bs, tables.shape[1] - 1)[:, None]
        blocks = jnp.where(active, jnp.take_along_axis(tables, index, axis=1)[:, 0], scratch)  # idle rows: scratch
        step = Step(write[:, None], None, memory.layers, blocks, active, self.products, start, write % bs, tables,
                    write[:, None], self.key_chunk)
        logits, caches = self._net.apply(params, tokens[:, None], step, jnp.zeros_like(write))
        advanced = jax.lax.dynamic_update_slice_in_dim(memory.positions, jnp.minimum(positions + 1, s), start, axis=0)
        return logits, Memory(caches, advanced)

    def prompt_logprobs(self, params: Params, tokens: Array, k: int) -> tuple[Array, Array, Array]:
        """tokens [1, T] (a padded prompt) -> the log-probability of each next prompt token [T] and the k most
        likely [T, k] (+ ids), from one full pass over the prompt (transformer.prompt_logprobs)."""
        n = tokens.shape[1]
        positions = jnp.arange(n, dtype=jnp.int32)[None, :]
        mask = jnp.tril(jnp.ones((n, n), bool))[None] & (tokens != self.cfg.pad_token)[:, None, :]
        chunk = next(c for c in (16, 8, 4, 2, 1) if n % c == 0)
        return self._scorer.apply(params, tokens, Step(positions, mask, None, None, products=self.products), k, chunk)

    def forward(self, params: Params, tokens: Array) -> Array:
        """Full pass without memory: tokens [B, T] -> logits [B, T, V] float32 (pad keys masked)."""
        n = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], tokens.shape)
        mask = jnp.tril(jnp.ones((n, n), bool))[None] & (tokens != self.cfg.pad_token)[:, None, :]
        logits, _ = self._net.apply(params, tokens, Step(positions, mask, None, None, products=self.products), None)
        return logits

    def insert(self, memory: Memory, prefix: Memory, slot: Array, table: Array | None = None,
               row: Array | int = 0) -> Memory:
        """Copy row `row` of a prefill result into the blocks `table` [table_len] lists for `slot` (default: the
        slot's dense_tables row); the slot's position becomes the prompt length."""
        if table is None:
            table = jnp.asarray(self.dense_tables(memory.positions.shape[0]))[slot]
        return kv_memory.insert(memory, prefix, slot, table, row)

    def memory_shardings(self, slots: int, num_blocks: int | None = None) -> Memory:
        t = self.cfg.model
        blocks = num_blocks if num_blocks is not None else slots * self.blocks_per_sequence
        return kv_memory.memory_shardings(self.mesh, slots, blocks, self.block_size, t.num_layers, t.num_kv_heads,
                                          t.key_size)

    def params_shardings(self, params: Params) -> Any:
        return params_shardings(params, self.mesh)

    def init_param_shapes(self) -> Any:
        """Shapes of haiku's own parameter tree for this network (reference layout), for layout checks."""
        n = 8
        step = Step(jnp.zeros((1, n), jnp.int32), jnp.ones((1, n, n), bool), None, None)
        return jax.eval_shape(lambda: self._net.init(jax.random.PRNGKey(0), jnp.zeros((1, n), jnp.int32),
                                                     step, None))
