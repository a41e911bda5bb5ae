"""The parameter tree of the Grok-1 network: names, shapes and kinds exactly as the reference's, plus
conversions between the released checkpoint layout and the in-memory layout, and int8 quantisation.

Checkpoint layout: int8 [..., K, N] + bfloat16 scales [..., blocks, N]. In memory: column-parallel int8 as
[..., N, K] (one-time transpose), row-parallel kept [..., K, N] (see layers.QuantizedWeight), float32 scales; embeddings in the compute dtype; norms and router float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from model_service.config import ModelConfig
from model_service.model.layers import ExpertStack, QuantizedWeight
from model_service.model.packed import PackedWeight, pack_experts, pack_float, pack_quantized

Params = dict[str, dict[str, Any]]

ROW_BLOCKS = 8  # row-parallel matrices carry 8 block scales along the contraction dim
EMBED = "language_model/in_out_embed"
UNIFORM_INT8_STD = float(np.sqrt((255**2 - 1) / 12))  # std of integers uniform on [-127, 127]
FINAL_NORM = "language_model/rms_norm"


@dataclass(frozen=True)
class TensorSpec:
    """One leaf of TrainingState(params=...): haiku module path, parameter name, reference shape [..., K, N]."""

    module: str
    name: str
    shape: tuple[int, ...]
    blocks: int = 0  # 0: plain float32 array; 1: column-parallel int8; 8: row-parallel int8

    @property
    def quantized(self) -> bool:
        return self.blocks > 0

    @property
    def ckpt_path(self) -> str:
        return f"params/{self.module}/{self.name}"

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-2], self.blocks, self.shape[-1])


def layer_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    t = cfg.model
    d, f, e = t.emb_size, t.ffn_size, t.num_experts
    pre = f"transformer/decoder_layer_{i}"
    mha = f"{pre}/multi_head_attention"
    specs = [
        TensorSpec(f"{pre}/moe/linear", "w", (e, d, f), 1),
        TensorSpec(f"{pre}/moe/linear_1", "w", (e, f, d), ROW_BLOCKS),
        TensorSpec(f"{pre}/moe/linear_v", "w", (e, d, f), 1),
        TensorSpec(f"{mha}/key", "w", (d, t.num_kv_heads * t.key_size), 1),
        TensorSpec(f"{mha}/linear", "w", (t.num_q_heads * t.key_size, d), ROW_BLOCKS),
        TensorSpec(f"{mha}/query", "w", (d, t.num_q_heads * t.key_size), 1),
        TensorSpec(f"{mha}/value", "w", (d, t.num_kv_heads * t.key_size), 1),
        TensorSpec(f"{pre}/router", "w", (d, e)),
    ]
    specs += [TensorSpec(f"{pre}/{n}", "scale", (d,)) for n in ("rms_norm", "rms_norm_1", "rms_norm_2", "rms_norm_3")]
    return specs


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every parameter in tree-flatten order (sorted module path, then name), i.e. checkpoint file order."""
    specs = [TensorSpec(EMBED, "embeddings", (cfg.vocab_size, cfg.model.emb_size)),
             TensorSpec(FINAL_NORM, "scale", (cfg.model.emb_size,))]
    for i in range(cfg.model.num_layers):
        specs += layer_specs(cfg, i)
    return sorted(specs, key=lambda s: (s.module, s.name))


def quantize(w: np.ndarray, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """float [..., K, N] -> (int8 [..., K, N], bfloat16 scales [..., blocks, N]) as in the released checkpoint."""
    *lead, k, n = w.shape
    wb = w.reshape(*lead, blocks, k // blocks, n)
    scale = (np.abs(wb).max(axis=-2, keepdims=True) / 127.0).astype(ml_dtypes.bfloat16)
    safe = np.where(scale.astype(np.float32) == 0, 1.0, scale.astype(np.float32))
    q = np.clip(np.round(wb / safe), -127, 127).astype(np.int8).reshape(w.shape)
    return q, scale.reshape(*lead, blocks, n)


def to_internal(spec: TensorSpec, leaf: Any, dtype: Any) -> Any:
    """A checkpoint leaf (numpy, or (weight, scales) for int8) -> its in-memory numpy form."""
    # Only views, swapaxes and astype here: a checkpoint leaf may be a file_arrays.FileArray whose bytes are
    # read later, device shard by device shard (the copy into device memory makes the layout contiguous).
    if spec.quantized:
        weight, scales = leaf
        if spec.blocks == 1:
            weight = weight.swapaxes(-1, -2)
        if "/moe/" in spec.module + "/":
            return ExpertStack(tuple(QuantizedWeight(weight[e], scales[e].astype(np.float32))
                                     for e in range(weight.shape[0])))
        return QuantizedWeight(weight, scales.astype(np.float32))
    if spec.module == EMBED:
        return leaf.astype(jnp.dtype(dtype))
    return np.asarray(leaf, np.float32)


def packable(module: str, leaf: Any) -> bool:
    """Whether native products read this leaf packed: every int8 matrix, the router and a float32 embedding
    table (not yet packed); norms and a bfloat16 table never."""
    if isinstance(leaf, ExpertStack):
        return isinstance(leaf.experts[0], QuantizedWeight)
    if isinstance(leaf, QuantizedWeight):
        return True
    if isinstance(leaf, PackedWeight) or np.dtype(leaf.dtype) != np.float32:
        return False
    return module.endswith("/router") or module == EMBED


def pack_for_native(module: str, leaf: Any, mesh: Any) -> Any:
    """An in-memory host leaf -> its form for native products (packed.py); leaves that are not `packable`
    come back unchanged."""
    if not packable(module, leaf):
        return leaf
    if isinstance(leaf, ExpertStack):
        return pack_experts(leaf, mesh)
    if isinstance(leaf, QuantizedWeight):
        return pack_quantized(leaf, mesh)
    if module == EMBED:
        return pack_float(np.asarray(leaf).T, mesh, table=True)
    return pack_float(np.asarray(leaf), mesh)


def to_checkpoint(spec: TensorSpec, leaf: Any) -> Any:
    """An in-memory leaf -> the released layout (numpy array, or (int8 weight, bfloat16 scales))."""
    if spec.quantized:
        if isinstance(leaf, ExpertStack):
            leaf = QuantizedWeight(np.stack([np.asarray(q.weight) for q in leaf.experts]),
                                   np.stack([np.asarray(q.scales) for q in leaf.experts]))
        weight = np.asarray(leaf.weight)
        if leaf.transposed:
            weight = np.swapaxes(weight, -1, -2)
        return np.ascontiguousarray(weight), np.asarray(leaf.scales).astype(ml_dtypes.bfloat16)
    return np.asarray(leaf, np.float32)


def random_leaf(spec: TensorSpec, cfg: ModelConfig, rng: np.random.Generator) -> Any:
    """Random weights in checkpoint layout, scaled so outputs vary (logit std ~2), like golden's recipe."""
    d = cfg.model.emb_size
    emb_std = 0.002
    if spec.quantized:  # int8 drawn directly (fast even for large configs), scales give std gain/sqrt(K)
        gain = 3.0 if spec.module.endswith(("query", "key")) else 1.0
        weight = rng.integers(-127, 128, spec.shape, dtype=np.int8)
        target = gain / np.sqrt(spec.shape[-2]) / UNIFORM_INT8_STD
        scales = rng.uniform(0.9 * target, 1.1 * target, spec.scales_shape).astype(ml_dtypes.bfloat16)
        return weight, scales
    if spec.module == EMBED:
        return rng.standard_normal(spec.shape, dtype=np.float32) * emb_std
    if spec.module == FINAL_NORM:
        target = 2.0 / (cfg.output_multiplier_scale * emb_std * np.sqrt(d))
        return rng.uniform(0.75 * target, 1.25 * target, spec.shape).astype(np.float32)
    if spec.name == "w":  # router
        return rng.standard_normal(spec.shape, dtype=np.float32) * (2.0 / np.sqrt(d))
    low, high = (0.5, 1.5) if spec.module.endswith(("rms_norm", "rms_norm_2")) else (1.0, 3.0)
    return rng.uniform(low, high, spec.shape).astype(np.float32)


def set_leaf(params: Params, spec: TensorSpec, value: Any) -> None:
    params.setdefault(spec.module, {})[spec.name] = value
