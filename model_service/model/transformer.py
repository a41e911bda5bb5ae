"""The Grok-1 network as haiku modules with the reference's parameter names.

Top-level modules: `language_model` (in_out_embed, final rms_norm) and `transformer` (decoder_layer_i with
multi_head_attention/{query,key,value,linear}, router, moe/{linear,linear_v,linear_1}, rms_norm..rms_norm_3).
Two entry points share the layers: `forward`, a dense pass over whole sequences (parity checks), and `hidden`,
the serving step: a list of token rows, each one token of some sequence at some position, written into and
attending over the paged KV pools (`Step` says which). `head` and `score` turn a step's rows into logits.
Those unroll the layers (one copy of a layer's computation per layer in the program: the CPU backend's form).
The scanned form (Backend.scan_layers: the generic backend's) runs `embedded`, then `scan_layers`: one loop
body, `stacked_layer`, over parameters stacked along a leading layer axis (module `transformer/decoder_layers`)
and the pools stacked the same way, so the program, and its compile time, do not grow with the depth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from model_service.config import ModelConfig
from model_service.kv_memory import KVMemory, LayerPool, Pools, block_size_of, write_tokens
from model_service.model.layers import QuantizedWeight, apply_rope, attention, rms_norm
from model_service.model.moe import MoELayer, ParamHolder, route
from model_service.model.packed import PackedWeight
import model_service.model.transcendental as transcendental
from model_service.model.weights import InLayer
from model_service.sharding import DATA, LAYER_STACK, MODEL, constrain

if TYPE_CHECKING:
    from model_service.ops.base import Ops

Array = jax.Array


class Step(NamedTuple):
    """What one forward call needs besides tokens [B, T].

    Dense (full passes for parity and training checks): `mask` says which of the call's tokens each query sees,
    keys are the call's own tokens. Paged (the serving step): every row is one token (T == 1) of sequence
    `seq[b]` at `positions[b, 0]`; its key and value go into the pool block its sequence's table lists for
    that position, then it attends to its sequence's keys at positions 0..positions[b, 0] read through the
    table (Ops.attend). Rows not `active` (padding) write into the scratch block, attend to nothing and never
    make an expert run. `ops` is how every backend-dependent operation runs (ops.Ops)."""

    positions: Array  # [B, T] int32 rotary positions
    mask: Array | None = None  # dense: [B, T, S] bool
    pools: Pools | None = None  # paged: each layer's block pool (stacked in one KVMemory: scanned layers)
    active: Array | None = None  # paged: [B] bool, the rows that hold a token
    seq: Array | None = None  # paged: [B] int32, each row's sequence (a row of `tables`)
    tables: Array | None = None  # paged: [S, table_len] int32, each sequence's blocks in position order
    ops: "Ops | None" = None  # static: the backend's operations (products, attention, experts, row sums)
    key_chunk: int = 0  # static, paged: keys are attended in chunks of this many positions


def _norm(name: str, x: Array, step: Step) -> Array:
    return rms_norm(x, ParamHolder(name).get("scale", (x.shape[-1],)), step.ops.row_sums)


def _linear(name: str, x: Array, out: int, step: Step) -> Array:
    """x [B, T, K] -> [B, T, out]; the rows of free slots need not be computed (Ops.product's `used`)."""
    w = ParamHolder(name).get("w", (x.shape[-1], out))
    used = None if step.active is None else jnp.broadcast_to(step.active[:, None], x.shape[:2])
    return step.ops.product(x, w if isinstance(w, (QuantizedWeight, PackedWeight)) else w.T, used)  # plain: init


def _write(pool: Array | LayerPool, new: Array, step: Step) -> Array | LayerPool:
    """This call's keys or values new [B, Hkv, 1, D] into their blocks, one token per row; padding rows write
    into the scratch block (the pool's last)."""
    bs, scratch = block_size_of(pool), pool.shape[0] - 1
    pos = step.positions[:, 0]
    blocks = jnp.take_along_axis(step.tables[step.seq], (pos // bs)[:, None], axis=1)[:, 0]
    return write_tokens(pool, new[:, :, 0, :], jnp.where(step.active, blocks, scratch), pos % bs)


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
                out = step.ops.attend(q[:, 0], full.k, full.v, step.tables, step.seq, step.positions[:, 0],
                                      step.active, t.attn_output_multiplier, step.key_chunk)[:, None]
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
        attn, kv = MultiHeadAttention(self.cfg, self.mesh)(_norm("rms_norm", h, step), step, cache)
        h = self._constrain(h + _norm("rms_norm_1", attn, step))
        moe_in = _norm("rms_norm_2", h, step)
        b, n, d = moe_in.shape
        router_w = ParamHolder("router").get("w", (d, t.num_experts))
        with jax.named_scope("router"):
            routing = route(moe_in.reshape(b * n, d), router_w, t.num_selected_experts, step.ops)
        moe_out = MoELayer(t.num_experts, t.ffn_size, self.mesh)(moe_in, routing, step.active, step.ops)
        return self._constrain(h + _norm("rms_norm_3", moe_out, step)), kv

    def _constrain(self, h: Array) -> Array:
        spec = P(DATA, None, MODEL) if self.cfg.model.shard_activations else P(DATA)
        return constrain(h, self.mesh, spec)


class Transformer(hk.Module):
    def __init__(self, cfg: ModelConfig, mesh: Mesh, name: str = "transformer") -> None:
        super().__init__(name=name)
        self.cfg = cfg
        self.mesh = mesh

    def __call__(self, h: Array, step: Step) -> tuple[Array, Pools]:
        caches = []
        for i in range(self.cfg.model.num_layers):
            cache = step.pools[i] if step.pools is not None else None
            h, kv = DecoderLayer(self.cfg, self.mesh, name=f"decoder_layer_{i}")(h, step, cache)
            caches.append(kv)
        return h, tuple(caches)


def stacked_layer(cfg: ModelConfig, mesh: Mesh, h: Array, step: Step,
                  cache: KVMemory | None) -> tuple[Array, KVMemory]:
    """Haiku-transformed: one decoder layer under LAYER_STACK's module name, the body `scan_layers` runs once per
    layer with that layer's slice of the stacked parameters."""
    with hk.name_scope(LAYER_STACK.split("/")[0]):
        return DecoderLayer(cfg, mesh, name=LAYER_STACK.split("/")[1])(h, step, cache)


LayerFn = Callable[[Any, Array, Step, "KVMemory | None"], tuple[Array, KVMemory]]


def scan_layers(layer: LayerFn, params: Any, h: Array, step: Step) -> tuple[Array, KVMemory | None]:
    """h [B, T, D] through every decoder layer as one loop: `layer` (stacked_layer's apply) over the parameters
    under LAYER_STACK ([layers, ...] each) -> the last layer's output and, paged, the pools (step.pools stacked
    [layers, ...]) with the rows' keys and values written in place. Each iteration takes its layer's slice of the
    parameters, but the experts' matrices stay whole, as that layer's InLayer: the expert forms read a layer's
    experts where they multiply them (in the kernel, in an expert's conditional), not as a copy of them all."""
    stack = {module: leaves for module, leaves in params.items() if module.startswith(LAYER_STACK)}
    if not stack:
        raise ValueError(f"scanned layers read parameters stacked under {LAYER_STACK!r}: load them with "
                         "checkpoint.load_params(..., stack_layers=True) or lay them out with GrokModel.pack_params")
    experts = {module: leaves for module, leaves in stack.items() if module.startswith(LAYER_STACK + "moe/")}
    sliced = {module: leaves for module, leaves in stack.items() if module not in experts}
    count = jax.tree.leaves(stack)[0].shape[0]
    inner = step._replace(pools=None)

    def body(carry: tuple[Array, KVMemory | None], xs: tuple[Any, Array]) -> tuple[Any, None]:
        h, pools = carry
        one, i = xs
        one = one | {module: {name: InLayer(leaf, i) for name, leaf in leaves.items()}
                     for module, leaves in experts.items()}
        cache = None if pools is None else KVMemory(LayerPool(pools.k, i), LayerPool(pools.v, i))
        h, kv = layer(one, h, inner, cache)
        return (h, None if pools is None else KVMemory(kv.k.stacked, kv.v.stacked)), None

    (h, pools), _ = jax.lax.scan(body, (h, step.pools), (sliced, jnp.arange(count, dtype=jnp.int32)))
    return h, pools


class LanguageModelParams(NamedTuple):
    """The `language_model` scope: tied embedding table and final norm scale."""

    embeddings: Array | PackedWeight  # [V, D] (packed for the native kernels: ops.native.Packed)
    norm_scale: Array  # [D]


HEAD_SCOPE = "language_model"  # the modules of the table and the final norm


def language_model_params(cfg: ModelConfig) -> LanguageModelParams:
    with hk.name_scope(HEAD_SCOPE):
        table = ParamHolder("in_out_embed").get("embeddings", (cfg.vocab_size, cfg.model.emb_size))
        scale = ParamHolder("rms_norm").get("scale", (cfg.model.emb_size,))
    return LanguageModelParams(table, scale)


def embed(cfg: ModelConfig, lm: LanguageModelParams, tokens: Array, dtype: jnp.dtype, ops: "Ops") -> Array:
    """tokens [B, T] -> [B, T, D] in `dtype` (the table's rows as the backend laid it out: Ops.embed), times
    embedding_multiplier_scale."""
    x = ops.embed(lm.embeddings, tokens).astype(dtype)
    return x * jnp.asarray(cfg.embedding_multiplier_scale, dtype)


def unembed(cfg: ModelConfig, lm: LanguageModelParams, h: Array, ops: "Ops",
            used: Array | None = None, fill_unused: bool = True, row_sums: bool = False) -> Array:
    """Final norm, then the tied unembedding (Ops.unembed): h [..., D] -> float32 logits [..., V]. Rows not `used`
    (bool over h's leading dims: a decode step's free slots) need no logits; forms that skip them give zeros (or
    with `fill_unused` False not even written: undefined, for a caller that never reads them). `row_sums`: the
    norm's mean square in layers.row_sum's fixed order (see head)."""
    h = rms_norm(h, lm.norm_scale, row_sums)
    return ops.unembed(h, lm.embeddings, cfg.output_multiplier_scale, used, fill_unused)


def embedded(cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, ops: "Ops", tokens: Array) -> Array:
    """Haiku-transformed: tokens [B, T] -> the first layer's input [B, T, D]."""
    return constrain(embed(cfg, language_model_params(cfg), tokens, dtype, ops), mesh, P(DATA, None, MODEL))


def forward(cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, tokens: Array, step: Step) -> Array:
    """Haiku-transformed dense pass (parity checks): tokens [B, T] -> float32 logits [B, T, V]."""
    lm = language_model_params(cfg)
    x = constrain(embed(cfg, lm, tokens, dtype, step.ops), mesh, P(DATA, None, MODEL))
    h, _ = Transformer(cfg, mesh)(x, step)
    with jax.named_scope("unembed"):
        return unembed(cfg, lm, h, step.ops)


def hidden(cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, tokens: Array, step: Step) -> tuple[Array, Pools]:
    """Haiku-transformed paged pass over token rows: tokens [R, 1] -> the last layer's output [R, 1, D] (before
    the final norm) and the pools with the rows' keys and values written."""
    lm = language_model_params(cfg)
    x = constrain(embed(cfg, lm, tokens, dtype, step.ops), mesh, P(DATA, None, MODEL))
    return Transformer(cfg, mesh)(x, step)


def head(cfg: ModelConfig, h: Array, ops: "Ops", used: Array | None) -> Array:
    """Haiku-transformed (the same parameters): rows h [P, D] -> float32 logits [P, V]; rows not `used` [P] get
    none (where the forms skip them their values are undefined: the sampler reads a row only for a draw it makes,
    and writing [V] zeros for each free slot cost ~2 ms a step at 16 slots). Ops.head_row_sums: the final norm's
    sum in a fixed order (layers.row_sum), so a row's logits do not depend on P: XLA:CPU hands a reduction of 4,096
    elements or more to YNNPACK, which sums in another order than its own loop, so its mean over [4, 512] and
    over [20, 512] (a plain engine's draws and a speculative one's) gave a row other bits (issue 64)."""
    with jax.named_scope("unembed"):
        return unembed(cfg, language_model_params(cfg), h, ops, used, fill_unused=False, row_sums=ops.head_row_sums)


def score(cfg: ModelConfig, h: Array, targets: Array, used: Array, ops: "Ops",
          k: int) -> tuple[Array, Array, Array]:
    """Haiku-transformed: how likely the network finds each row's next token (vLLM's prompt_logprobs).

    h [C, D] rows, targets [C] int32 (the token that follows each row), used [C] bool -> (log-probability of the
    target [C], the k largest log-probabilities [C, k], their ids [C, k]) under the raw logits' log-softmax;
    Ops.head_row_sums as in head (the logits then are the head's bits; the log-softmax over [C, V] is not: the engine
    scores in tiles of one size, and XLA:CPU's exp too takes another form from 4,096 elements)."""
    logits = unembed(cfg, language_model_params(cfg), h, ops, used, row_sums=ops.head_row_sums)
    logprobs = transcendental.log_softmax(logits, axis=-1)  # [C, V]
    top, ids = jax.lax.top_k(logprobs, k)
    return jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0], top, ids.astype(jnp.int32)
