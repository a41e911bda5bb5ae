"""GrokModel: the Grok-1 network's pure, jit-able entry points for the serving engine.

`rows` (one serving step: token rows of any sequences at any positions, written into and attending over the
paged KV pools), `head` / `score` (a step's rows to logits / prompt log-probabilities), full-sequence
`forward` for parity checks, and the sharding pytrees the engine jits with. The layers run unrolled or, with
Backend.scan_layers, as one loop over stacked parameters and pools (transformer.scan_layers).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from model_service import kv_memory
from model_service.config import MeshConfig, ModelConfig, validate
from model_service.kv_memory import KVMemory, Pools
from model_service.model.layers import Products, QuantizedWeight
from model_service.model.params import Params
from model_service.model.stacking import stack_params
from model_service.model.transformer import (HEAD_SCOPE, Step, embedded, forward, head, hidden, scan_layers, score,
                                             stacked_layer)
from model_service.sharding import DATA, EXPERT, MODEL, params_shardings

__all__ = ["GrokModel", "KVMemory", "Params", "Pools", "Products", "QuantizedWeight", "TokenRows"]

Array = jax.Array
BLOCK_SIZE = 16  # positions per KV block
KEY_CHUNK = 128  # key positions per attention chunk (a multiple of the block size)



class TokenRows(NamedTuple):
    """One step's token rows (GrokModel.rows): every leaf but `tables` leads with the row axis [R]."""

    tokens: Array  # [R] int32
    positions: Array  # [R] int32, each row's position in its sequence
    seq: Array  # [R] int32, each row's sequence: its row of `tables`
    valid: Array  # [R] bool, False for padding rows
    tables: Array | None  # [S, table_len] int32 block tables


class GrokModel:
    """The network bound to a config, a mesh and a compute dtype (float32 or bfloat16).

    `backend` (default: backend.choose_backend("auto")) says how it computes; `products` / `attention` override its
    choices (tests, tools). The operations that differ per backend run through `self.ops` (model_service/ops/), so
    no code here asks which ran. Parameters are laid out for it by pack_params (or checkpoint.load_params).
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, products: Products | None = None,
                 block_size: int = BLOCK_SIZE, key_chunk: int = KEY_CHUNK, attention: str | None = None,
                 backend: Any = None) -> None:
        validate(cfg, MeshConfig(data=mesh.shape[DATA], model=mesh.shape[MODEL], expert=mesh.shape[EXPERT]))
        if block_size < 1 or block_size & (block_size - 1) or key_chunk % block_size:
            raise ValueError(f"the KV block size must be a power of two dividing {key_chunk}, got {block_size}")
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"compute dtype must be float32 or bfloat16, got {dtype}")
        self.cfg = cfg
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        from model_service.backend import attention_heads, choose_backend, with_choices
        from model_service.ops import for_backend

        # Explicit products / attention (tests, tools) override the backend's; the engine reads the rest of it.
        self.backend = with_choices(backend or choose_backend(
            "auto", mesh, self.dtype, block_size=block_size, heads=attention_heads(cfg)), mesh, products, attention)
        # Every operation whose form differs per backend, derived from it once (model_service/ops/).
        self.ops = for_backend(self.backend, mesh)
        self.products = self.backend.products
        self.block_size = block_size
        # Keys are read in chunks of key_chunk positions, only as many as the longest sequence in a step holds.
        self.key_chunk = min(key_chunk, -(-cfg.sequence_len // block_size) * block_size)
        self.table_len = -(-cfg.sequence_len // self.key_chunk) * self.key_chunk // block_size  # entries per slot
        self.attention = self.backend.attention
        least = self.ops.min_block_size(self.dtype)
        if block_size % least:
            raise ValueError(f"--attention {self.attention} reads KV blocks of {least} positions or more in "
                             f"{self.dtype.name} (a block fills whole tiles), got --block-size {block_size}: use "
                             f"--block-size {least} or more")
        self.moe = self.backend.moe
        # A row's bits independent of how many rows a serving program holds (Ops.row_sums, Ops.head_row_sums).
        self.row_sums = self.ops.row_sums
        # Scanned layers (the generic backend's default): the embedding, one layer run as a loop, the head apart.
        self.scan_layers = self.backend.scan_layers
        self._forward = hk.without_apply_rng(hk.transform(functools.partial(forward, cfg, mesh, self.dtype)))
        self._hidden = hk.without_apply_rng(hk.transform(functools.partial(hidden, cfg, mesh, self.dtype)))
        self._embed = hk.without_apply_rng(hk.transform(functools.partial(embedded, cfg, mesh, self.dtype, self.ops)))
        self._layer = hk.without_apply_rng(hk.transform(functools.partial(stacked_layer, cfg, mesh)))
        self._head = hk.without_apply_rng(hk.transform(
            lambda h, used: head(cfg, h, self.ops, used)))
        self._score = hk.without_apply_rng(hk.transform(
            lambda h, targets, used, k: score(cfg, h, targets, used, self.ops, k)))

    def pack_params(self, params: Params) -> Params:
        """`params` laid out for this model's backend (Ops.lay_out: packed for the native kernels, experts stacked
        for the grouped forms, or as loaded), each changed leaf a copy placed like a loaded one; with scanned layers
        every layer's leaves stacked (stacking.stack_params). Trees already laid out come back as they are."""
        out = self.ops.lay_out(params, self.mesh)
        return stack_params(out, self.cfg.model.num_layers, self.mesh) if self.scan_layers else out

    def load_options(self) -> dict[str, Any]:
        """checkpoint.load_params' (and random_params') options that lay the parameters out as they load, as
        pack_params would after: the backend's layout (Ops.layout: `pack`, `int8_table`, `stacked` experts for the
        MoE form `moe`), the layers stacked where they are scanned."""
        return {**self.ops.layout.load_options(), "stack_layers": self.scan_layers, "moe": self.moe}

    def init_pools(self, num_blocks: int) -> Pools:
        """Empty paged KV memory: every layer's pool of `num_blocks` blocks (+ the scratch block)."""
        t = self.cfg.model
        return kv_memory.init_pools(num_blocks, self.block_size, t.num_layers, t.num_kv_heads, t.key_size, self.dtype,
                                    self.kv_layout, self.scan_layers)

    def pools_shardings(self, num_blocks: int) -> Pools:
        t = self.cfg.model
        return kv_memory.pools_shardings(self.mesh, num_blocks, self.block_size, t.num_layers, t.num_kv_heads,
                                         t.key_size, self.kv_layout, self.scan_layers)

    @property
    def kv_layout(self) -> str:
        """The pools' layout (kv_memory.LAYOUTS) the backend's attention reads (Ops.kv_layout): "tokens" for batched
        attention (accelerators: a token's keys one row, lane-dense whatever the key size), "heads" for the CPU's
        per-row forms."""
        return self.ops.kv_layout

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks that hold a full context."""
        return -(-self.cfg.sequence_len // self.block_size)

    def dense_tables(self, slots: int) -> np.ndarray:
        """[slots, table_len] int32: sequence i owns blocks i * blocks_per_sequence onward (a pool of
        slots * blocks_per_sequence blocks), entries past a full context point at the scratch block. For tests and
        tools without a block manager."""
        per = self.blocks_per_sequence
        tables = np.full((slots, self.table_len), slots * per, np.int32)
        tables[:, :per] = np.arange(slots * per, dtype=np.int32).reshape(slots, per)
        return tables

    def rows(self, params: Params, pools: Pools, rows: TokenRows, tile: int,
             tiles: Array | None = None) -> tuple[Array, Pools]:
        """One serving step's token rows -> (each row's last hidden state [R, D], before the final norm; the pools
        with every row's key and value written).

        Row r is token rows.tokens[r] of sequence rows.seq[r] at rows.positions[r]; it attends to that
        sequence's positions 0..positions[r] through rows.tables, including rows earlier in this step (a prompt
        is rows at consecutive positions). The rows run in tiles of `tile`, one after another, each through the
        same computation (a while loop over tiles: one compiled body), so a row's bits depend on nothing but its
        token, its position and its sequence's keys (with native products and per-row attention, whose rows are
        independent by construction), however a prompt is split over steps and whatever shares its step. Keys a
        row reads must be written by rows earlier in the step or in the same tile. `tiles` (traced, default all)
        runs only the first tiles; the rest of the rows come out zero."""
        with self.precision():
            return self._rows(params, pools, rows, tile, tiles)

    def precision(self) -> contextlib.AbstractContextManager[None]:
        """The matmul precision the network's programs are traced under (Ops.precision: XLA's highest for its dots,
        with the accurate transcendentals in the faithful mode; the CPU's own forms keep XLA's default)."""
        return self.ops.precision()

    def _rows(self, params: Params, pools: Pools, rows: TokenRows, tile: int,
              tiles: Array | None) -> tuple[Array, Pools]:
        r = rows.tokens.shape[0]
        if r % tile:
            raise ValueError(f"{r} token rows do not fill whole tiles of {tile}")
        t = self.cfg.model

        def one(i: Array, carry: tuple[Array, Pools]) -> tuple[Array, Pools]:
            out, pools = carry
            part = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i * tile, tile), rows._replace(tables=None))
            step = Step(part.positions[:, None], None, pools, part.valid, part.seq, rows.tables, self.ops,
                        self.key_chunk)
            h, pools = self._layers(params, part.tokens[:, None], step)
            return jax.lax.dynamic_update_slice_in_dim(out, h[:, 0].astype(out.dtype), i * tile, axis=0), pools

        out = jnp.zeros((r, t.emb_size), self.dtype)
        if r == tile:  # one tile: no loop (XLA-CPU runs a loop's body without intra-op parallelism)
            return one(jnp.int32(0), (out, pools))
        count = r // tile if tiles is None else tiles
        return jax.lax.fori_loop(0, count, one, (out, pools))

    def _layers(self, params: Params, tokens: Array, step: Step) -> tuple[Array, Pools | None]:
        """tokens [B, T] -> the last layer's output [B, T, D] and the pools written (paged)."""
        if not self.scan_layers:
            return self._hidden.apply(params, tokens, step)
        return scan_layers(self._layer.apply, params, self._embed.apply(params, tokens), step)

    def head_params(self, params: Params) -> Params:
        """The part of `params` that `head` and `score` read: the language model's table and final norm."""
        return {module: leaves for module, leaves in params.items() if module.startswith(f"{HEAD_SCOPE}/")}

    def head(self, params: Params, h: Array, used: Array | None = None) -> Array:
        """Rows h [P, D] (from `rows`) -> float32 logits [P, V]; rows not `used` get none (transformer.head)."""
        with self.precision():
            return self._head.apply(params, h, used)

    def score(self, params: Params, h: Array, targets: Array, used: Array, k: int) -> tuple[Array, Array, Array]:
        """Rows h [C, D] and the token following each, targets [C] -> (its log-probability [C], the k largest
        log-probabilities [C, k] and their ids [C, k]) from the raw logits (prompt logprobs)."""
        with self.precision():
            return self._score.apply(params, h, targets, used, k)

    def forward(self, params: Params, tokens: Array) -> Array:
        """Full pass without memory: tokens [B, T] -> logits [B, T, V] float32 (pad keys masked)."""
        n = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], tokens.shape)
        mask = jnp.tril(jnp.ones((n, n), bool))[None] & (tokens != self.cfg.pad_token)[:, None, :]
        step = Step(positions, mask, ops=self.ops.dense())
        with self.precision():
            if not self.scan_layers:
                return self._forward.apply(params, tokens, step)
            return self._head.apply(params, self._layers(params, tokens, step)[0], None)

    def params_shardings(self, params: Params) -> Any:
        return params_shardings(params, self.mesh)

    def init_param_shapes(self) -> Any:
        """Shapes of haiku's own parameter tree for this network (reference layout), for layout checks."""
        from model_service.ops import for_shapes

        n = 8
        step = Step(jnp.zeros((1, n), jnp.int32), jnp.ones((1, n, n), bool), ops=for_shapes())
        return jax.eval_shape(lambda: self._forward.init(jax.random.PRNGKey(0), jnp.zeros((1, n), jnp.int32), step))
