"""The Grok-1 network as haiku modules with the reference's parameter names.

Top-level modules: `language_model` (in_out_embed, final rms_norm) and `transformer` (decoder_layer_i with
multi_head_attention/{query,key,value,linear}, router, moe/{linear,linear_v,linear_1}, rms_norm..rms_norm_3).
One forward function serves full passes, prefill and decode: the caller supplies positions, the attention
mask and, for decode, the memory and each slot's write index.
"""

from __future__ import annotations

from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from model_service.config import ModelConfig
from model_service.kv_memory import KVMemory, write_blocks, write_tokens
from model_service.model.layers import (
    Products,
    QuantizedWeight,
    apply_rope,
    attention,
    paged_attention,
    paged_attention_rows,
    product,
    rms_norm,
)
from model_service.model.moe import MoELayer, ParamHolder, route
from model_service.model.packed import PackedWeight
from model_service.sharding import DATA, MODEL, constrain

Array = jax.Array


class Step(NamedTuple):
    """What one forward call needs besides tokens. B is the number of rows computed; in decode these are the
    memory's slots row_start .. row_start + B - 1 (the memory may hold more)."""

    positions: Array  # [B, T] int32 rotary positions
    mask: Array | None  # dense: [B, T, S] bool, which of this call's tokens each query sees (paged: see limit)
    memory: tuple[KVMemory, ...] | None  # paged pools to write into and read from; None: keys are this call's tokens
    write_to: Array | None  # paged: decode [B] the block each row's token goes to; a prefill chunk [C / block] blocks
    active: Array | None = None  # decode: [B] bool, False rows (free slots) never make an expert run
    products: Products = Products.DOT  # static: how token rows meet weights (layers.Products)
    row_start: Array | int = 0  # decode: memory slot of the first row
    write_at: Array | None = None  # decode: [B] offset of each row's token in its block (None: whole blocks)
    tables: Array | None = None  # paged: [B, table_len] the blocks each row reads, in position order
    limit: Array | None = None  # paged: [B, T] int32, query t of row b sees key positions 0..limit[b, t]
    key_chunk: int = 0  # static, paged: keys are attended in chunks of this many positions (paged_attention)


def _norm(name: str, x: Array) -> Array:
    return rms_norm(x, ParamHolder(name).get("scale", (x.shape[-1],)))


def _linear(name: str, x: Array, out: int, step: Step) -> Array:
    """x [B, T, K] -> [B, T, out]; in decode the rows of free slots are not computed (native products)."""
    w = ParamHolder(name).get("w", (x.shape[-1], out))
    used = None if step.active is None else jnp.broadcast_to(step.active[:, None], x.shape[:2])
    return product(x, w if isinstance(w, (QuantizedWeight, PackedWeight)) else w.T, step.products, used)  # plain: init


def _write(pool: Array, new: Array, step: Step) -> Array:
    """This call's keys or values new [B, Hkv, T, D] into their blocks: one token per row (decode), or one row's
    chunk of whole blocks (a prefill chunk)."""
    if step.write_at is None:
        return write_blocks(pool, new[0], step.write_to)
    return write_tokens(pool, new[:, :, 0, :], step.write_to, step.write_at)


class MultiHeadAttention(hk.Module):
    def __init__(self, cfg: ModelConfig, mesh: Mesh, name: str = "multi_head_attention") -> None:
        super().__init__(name=name)
        self.t = cfg.model
        self.mesh = mesh

    def __call__(self, x: Array, step: Step, cache: KVMemory | None) -> tuple[Array, KVMemory]:
        t, (b, n, _) = self.t, x.shape
        with jax.named_scope("qkv_projections"):
            q = _linear("query", x, t.num_q_heads * t.key_size, step).reshape(b, n, t.num_q_heads, t.key_size)
            k = _linear("key", x, t.num_kv_heads * t.key_size, step).reshape(b, n, t.num_kv_heads, t.key_size)
            v = _linear("value", x, t.num_kv_heads * t.key_size, step).reshape(b, n, t.num_kv_heads,
                                                                                       t.key_size)
            q, k = apply_rope(q, step.positions), apply_rope(k, step.positions)
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, Hkv, T, D]
        q = constrain(q, self.mesh, P(DATA, None, MODEL, None))
        if cache is not None:  # paged: this call's keys go into their blocks, then every key is read from there
            with jax.named_scope("kv_write"):
                full = KVMemory(*(_write(pool, new, step) for pool, new in ((cache.k, k), (cache.v, v))))
            with jax.named_scope("scores_softmax_values"):
                if step.active is None:  # a prefill chunk: one row
                    out = paged_attention(q, full.k, full.v, step.tables, step.limit, t.attn_output_multiplier,
                                          step.key_chunk)
                else:
                    out = paged_attention_rows(q, full.k, full.v, step.tables, step.limit,
                                               t.attn_output_multiplier, step.key_chunk, step.active)
        else:
            k, v = (constrain(a, self.mesh, P(DATA, MODEL, None, None)) for a in (k, v))
            full = KVMemory(k, v)
            with jax.named_scope("scores_softmax_values"):
                out = attention(q, k, v, step.mask, t.attn_output_multiplier)
        with jax.named_scope("output_projection"):
            return _linear("linear", out, x.shape[-1], step), full


class DecoderLayer(hk.Module):
    def __init__(self, cfg: ModelConfig, mesh: Mesh, name: str) -> None:
        super().__init__(name=name)
        self.cfg = cfg
        self.mesh = mesh

    def __call__(self, h: Array, step: Step, cache: KVMemory | None) -> tuple[Array, KVMemory]:
        t = self.cfg.model
        attn, kv = MultiHeadAttention(self.cfg, self.mesh)(_norm("rms_norm", h), step, cache)
        h = self._constrain(h + _norm("rms_norm_1", attn))
        moe_in = _norm("rms_norm_2", h)
        b, n, d = moe_in.shape
        router_w = ParamHolder("router").get("w", (d, t.num_experts))
        with jax.named_scope("router"):
            routing = route(moe_in.reshape(b * n, d), router_w, t.num_selected_experts, step.products)
        moe_out = MoELayer(t.num_experts, t.ffn_size)(moe_in, routing, step.active, step.products)
        return self._constrain(h + _norm("rms_norm_3", moe_out)), kv

    def _constrain(self, h: Array) -> Array:
        spec = P(DATA, None, MODEL) if self.cfg.model.shard_activations else P(DATA)
        return constrain(h, self.mesh, spec)


class Transformer(hk.Module):
    def __init__(self, cfg: ModelConfig, mesh: Mesh, name: str = "transformer") -> None:
        super().__init__(name=name)
        self.cfg = cfg
        self.mesh = mesh

    def __call__(self, h: Array, step: Step) -> tuple[Array, tuple[KVMemory, ...]]:
        caches = []
        for i in range(self.cfg.model.num_layers):
            cache = step.memory[i] if step.memory is not None else None
            h, kv = DecoderLayer(self.cfg, self.mesh, name=f"decoder_layer_{i}")(h, step, cache)
            caches.append(kv)
        return h, tuple(caches)


class LanguageModelParams(NamedTuple):
    """The `language_model` scope: tied embedding table and final norm scale."""

    embeddings: Array | PackedWeight  # [V, D] (packed for native products in float32)
    norm_scale: Array  # [D]


def language_model_params(cfg: ModelConfig) -> LanguageModelParams:
    with hk.name_scope("language_model"):
        table = ParamHolder("in_out_embed").get("embeddings", (cfg.vocab_size, cfg.model.emb_size))
        scale = ParamHolder("rms_norm").get("scale", (cfg.model.emb_size,))
    return LanguageModelParams(table, scale)


def embed(cfg: ModelConfig, lm: LanguageModelParams, tokens: Array, dtype: jnp.dtype) -> Array:
    """tokens [B, T] -> [B, T, D] in `dtype`, times embedding_multiplier_scale."""
    table = lm.embeddings
    x = (table.rows_of(tokens) if isinstance(table, PackedWeight) else jnp.take(table, tokens, axis=0)).astype(dtype)
    return x * jnp.asarray(cfg.embedding_multiplier_scale, dtype)


def unembed(cfg: ModelConfig, lm: LanguageModelParams, h: Array, products: Products,
            used: Array | None = None) -> Array:
    """Final norm, then the tied unembedding: h [..., D] -> float32 logits [..., V]. Rows not `used` (bool over
    h's leading dims: a decode step's free slots) need no logits; native products skip them (zeros)."""
    h = rms_norm(h, lm.norm_scale)
    table = lm.embeddings if isinstance(lm.embeddings, PackedWeight) else lm.embeddings.astype(jnp.float32)
    out = product(h.astype(jnp.float32), table, products, used)
    if h.dtype != jnp.float32:  # the reference's product and multiplier round to the compute dtype
        return (out.astype(h.dtype) * jnp.asarray(cfg.output_multiplier_scale, h.dtype)).astype(jnp.float32)
    return out * jnp.float32(cfg.output_multiplier_scale)


def forward(cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, tokens: Array, step: Step,
            last_index: Array | None) -> tuple[Array, tuple[KVMemory, ...]]:
    """Haiku-transformed body. Returns float32 logits ([B, V] at `last_index` [B], else [B, T, V]) and caches."""
    lm = language_model_params(cfg)
    x = constrain(embed(cfg, lm, tokens, dtype), mesh, P(DATA, None, MODEL))
    h, caches = Transformer(cfg, mesh)(x, step)
    used = None
    if last_index is not None:
        h = jnp.take_along_axis(h, last_index[:, None, None], axis=1)[:, 0]  # [B, D]
        used = step.active
    with jax.named_scope("unembed"):
        return unembed(cfg, lm, h, step.products, used), caches


def prompt_logprobs(cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, tokens: Array, step: Step, k: int,
                    chunk: int) -> tuple[Array, Array, Array]:
    """Haiku-transformed (same parameters as `forward`): how likely the network finds each prompt token.

    tokens [1, T] -> (logprob of token t + 1 after tokens ..t [T], top-k logprobs [T, k], their ids [T, k]),
    from the raw logits' log-softmax (vLLM's prompt_logprobs). The last row and rows past the prompt are
    meaningless. The [T, V] logits are never held at once: `chunk` rows are unembedded at a time.
    """
    lm = language_model_params(cfg)
    x = constrain(embed(cfg, lm, tokens, dtype), mesh, P(DATA, None, MODEL))
    h, _ = Transformer(cfg, mesh)(x, step)  # [1, T, D]
    t = tokens.shape[1]
    targets = jnp.roll(tokens[0], -1).reshape(t // chunk, chunk)

    def rows(args: tuple[Array, Array]) -> tuple[Array, Array, Array]:
        hidden, target = args  # [chunk, D], [chunk]
        logprobs = jax.nn.log_softmax(unembed(cfg, lm, hidden, step.products), axis=-1)  # [chunk, V]
        top, ids = jax.lax.top_k(logprobs, k)
        return jnp.take_along_axis(logprobs, target[:, None], axis=-1)[:, 0], top, ids.astype(jnp.int32)

    chosen, top, ids = jax.lax.map(rows, (h[0].reshape(t // chunk, chunk, -1), targets))
    return chosen.reshape(t), top.reshape(t, k), ids.reshape(t, k)
