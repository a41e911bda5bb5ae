"""The Grok-1 network for training: float parameters in the served model's tree and a differentiable forward.

The served network (model_service/model) cannot be differentiated: its MoE runs a data-dependent number of
tiles (a while loop) and skips unselected experts with conditionals. This forward computes every expert
densely and combines them with the router's top-k gates, which are zero elsewhere, so it is the same function
(tests/demo/test_network.py checks it against GrokModel.forward on the same float parameters). It is kept
separate on purpose: speed work on the served code can never change what the committed training run computes.

Every detail that decides the output follows the reference: four RMSNorms per layer (eps 1e-5), RoPE with half
rotation (base 10000), grouped-query attention whose scores are multiplied by `attn_output_multiplier`, capped
with 30*tanh(x/30) and masked with -1e30, a float32 router whose raw top-k softmax probabilities are the gates,
tanh-approximated GELU experts, embeddings times `embedding_multiplier_scale`, and tied unembedding times
`output_multiplier_scale`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model_service.config import ModelConfig
from model_service.model.params import EMBED, FINAL_NORM, Params, tensor_specs

Array = jax.Array

RMS_EPS = 1e-5
ROPE_BASE = 10000.0
ATTN_LOGIT_CAP = 30.0
MASK_VALUE = -1e30


def init_params(cfg: ModelConfig, key: Array) -> Params:
    """Float32 parameters for every tensor of the checkpoint, in the reference's shapes [..., K, N].

    Matrices are normal with std 1/sqrt(K) (unit-variance outputs); embeddings have std
    1/embedding_multiplier_scale so the scaled input starts at unit RMS; the router starts small so every
    expert is tried early on; norm scales start at 1.
    """
    params: Params = {}
    specs = tensor_specs(cfg)
    for spec, k in zip(specs, jax.random.split(key, len(specs))):
        if spec.module == EMBED:
            value = jax.random.normal(k, spec.shape) / cfg.embedding_multiplier_scale
        elif spec.name == "scale":
            value = jnp.ones(spec.shape)
        elif spec.module.endswith("/router"):
            value = jax.random.normal(k, spec.shape) * 0.02
        else:
            value = jax.random.normal(k, spec.shape) / jnp.sqrt(spec.shape[-2])
        params.setdefault(spec.module, {})[spec.name] = value.astype(jnp.float32)
    return params


def rms_norm(x: Array, scale: Array) -> Array:
    """x [..., D] -> scale * x / rms(x), in float32."""
    return scale * x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + RMS_EPS)


def rope(x: Array, positions: Array) -> Array:
    """Rotary embedding, half rotation. x [B, T, H, D], positions [T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (ROPE_BASE ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    phase = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, D/2]
    phase = jnp.concatenate([phase, phase], axis=-1)[None, :, None, :]  # [1, T, 1, D]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * jnp.cos(phase) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(phase)


def attention(cfg: ModelConfig, p: Params, prefix: str, x: Array, mask: Array) -> Array:
    """Grouped-query self-attention. x [B, T, D], mask [B, T, T] bool -> [B, T, D]."""
    t = cfg.model
    b, n, _ = x.shape
    group = t.num_q_heads // t.num_kv_heads
    q = (x @ p[f"{prefix}/query"]["w"]).reshape(b, n, t.num_kv_heads, group, t.key_size)
    k = (x @ p[f"{prefix}/key"]["w"]).reshape(b, n, t.num_kv_heads, t.key_size)
    v = (x @ p[f"{prefix}/value"]["w"]).reshape(b, n, t.num_kv_heads, t.key_size)
    positions = jnp.arange(n)
    q = rope(q.reshape(b, n, t.num_q_heads, t.key_size), positions).reshape(q.shape)  # head h -> kv head h // group
    k = rope(k, positions)
    scores = jnp.einsum("bthgd,bshd->bhgts", q, k) * t.attn_output_multiplier  # [B, Hkv, G, T, S]
    scores = ATTN_LOGIT_CAP * jnp.tanh(scores / ATTN_LOGIT_CAP)
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    out = jnp.einsum("bhgts,bshd->bthgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, n, t.num_q_heads * t.key_size) @ p[f"{prefix}/linear"]["w"]


def moe(cfg: ModelConfig, p: Params, prefix: str, x: Array) -> Array:
    """Top-k mixture of experts computed densely: x [B, T, D] -> [B, T, D].

    Every expert runs on every row and the outputs are combined with the gates, which are the raw softmax
    probabilities of the selected experts and zero for the others (the served MoE runs only the selected).
    """
    t = cfg.model
    probs = jax.nn.softmax(x @ p[f"{prefix}/router"]["w"], axis=-1)  # [B, T, E]
    gates, experts = jax.lax.top_k(probs, t.num_selected_experts)  # [B, T, k]
    combine = jnp.sum(jax.nn.one_hot(experts, t.num_experts) * gates[..., None], axis=-2)  # [B, T, E]
    h = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, p[f"{prefix}/moe/linear"]["w"]))
    h = h * jnp.einsum("btd,edf->btef", x, p[f"{prefix}/moe/linear_v"]["w"])  # [B, T, E, F]
    return jnp.einsum("btef,efd,bte->btd", h, p[f"{prefix}/moe/linear_1"]["w"], combine)


def forward(cfg: ModelConfig, params: Params, tokens: Array) -> Array:
    """tokens [B, T] int32 -> logits [B, T, V] float32 (causal; pad keys masked as the served model does)."""
    n = tokens.shape[1]
    table = params[EMBED]["embeddings"]  # [V, D]
    mask = jnp.tril(jnp.ones((n, n), bool))[None] & (tokens != cfg.pad_token)[:, None, :]  # [B, T, T]
    h = table[tokens] * cfg.embedding_multiplier_scale
    for i in range(cfg.model.num_layers):
        pre = f"transformer/decoder_layer_{i}"
        attn = attention(cfg, params, f"{pre}/multi_head_attention", rms_norm(h, params[f"{pre}/rms_norm"]["scale"]),
                         mask)
        h = h + rms_norm(attn, params[f"{pre}/rms_norm_1"]["scale"])
        moe_out = moe(cfg, params, pre, rms_norm(h, params[f"{pre}/rms_norm_2"]["scale"]))
        h = h + rms_norm(moe_out, params[f"{pre}/rms_norm_3"]["scale"])
    h = rms_norm(h, params[FINAL_NORM]["scale"])
    return (h @ table.T) * cfg.output_multiplier_scale


def token_losses(cfg: ModelConfig, params: Params, tokens: Array) -> Array:
    """Next-token cross-entropy in nats at every position but the last: tokens [B, T] -> [B, T-1]."""
    logits = forward(cfg, params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
