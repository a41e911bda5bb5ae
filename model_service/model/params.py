"""The parameter tree of the Grok-1 network: names, shapes and kinds exactly as the reference's, plus
conversions between the released checkpoint layout and the in-memory layout, and int8 quantisation.

Checkpoint layout: int8 [..., K, N] + bfloat16 scales [..., blocks, N]; the embedding table bfloat16 in the
released Grok-1 (float32 in some checkpoints: both are read). In memory: column-parallel int8 as [..., N, K]
(one-time transpose), row-parallel kept [..., K, N] (see layers.QuantizedWeight), float32 scales; the
embeddings in the compute dtype, or, packed for native products, in the checkpoint's own type; norms and
router float32.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from model_service.config import ModelConfig
from model_service.model.grouped import ALIGN, kernel_layout, pads
from model_service.model.layers import ExpertStack, QuantizedWeight
from model_service.model.weights import GroupedWeight
from model_service.model.packed import PackedWeight, pack_experts, pack_float, pack_quantized, pack_table

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


def to_internal(spec: TensorSpec, leaf: Any, dtype: Any, native: bool = False, stacked: bool = False) -> Any:
    """A checkpoint leaf (numpy, or (weight, scales) for int8) -> its in-memory numpy form. `native`: the leaf
    is about to be packed for native products, which read a bfloat16 table as it is stored (exactly). `stacked`:
    an MoE matrix stays one [E, K, N] array in the checkpoint's layout (weights.GroupedWeight, the generic
    backend's grouped products) instead of one matrix per expert."""
    # Only views, swapaxes and astype here: a checkpoint leaf may be a file_arrays.FileArray whose bytes are
    # read later, device shard by device shard (the copy into device memory makes the layout contiguous).
    if spec.quantized:
        weight, scales = leaf
        if stacked and "/moe/" in spec.module + "/":
            return GroupedWeight(weight, scales.astype(np.float32))
        if spec.blocks == 1:
            weight = weight.swapaxes(-1, -2)
        if "/moe/" in spec.module + "/":
            return ExpertStack(tuple(QuantizedWeight(weight[e], scales[e].astype(np.float32))
                                     for e in range(weight.shape[0])))
        return QuantizedWeight(weight, scales.astype(np.float32))
    if spec.module == EMBED:
        keep = native and np.dtype(leaf.dtype) == np.dtype(ml_dtypes.bfloat16)
        return leaf if keep else leaf.astype(jnp.dtype(dtype), copy=False)  # already in dtype: not copied
    return np.asarray(leaf, np.float32)


def packable(module: str, leaf: Any) -> bool:
    """Whether native products read this leaf packed: every int8 matrix, the float32 router and a float32 or
    bfloat16 embedding table (not yet packed); norms never."""
    if isinstance(leaf, ExpertStack):
        return isinstance(leaf.experts[0], QuantizedWeight)
    if isinstance(leaf, QuantizedWeight):
        return True
    if isinstance(leaf, PackedWeight):
        return False
    if module == EMBED:
        return np.dtype(leaf.dtype) in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
    return module.endswith("/router") and np.dtype(leaf.dtype) == np.float32


def pack_for_native(module: str, leaf: Any, mesh: Any, int8_table: bool = False) -> Any:
    """An in-memory host leaf -> its form for native products (packed.py); leaves that are not `packable`
    come back unchanged. `int8_table`: the embedding table rounded to int8 (packed.pack_table)."""
    if not packable(module, leaf):
        return leaf
    if isinstance(leaf, ExpertStack):
        return pack_experts(leaf, mesh)
    if isinstance(leaf, QuantizedWeight):
        return pack_quantized(leaf, mesh)
    if module == EMBED:
        return pack_table(leaf, mesh, int8_table)
    return pack_float(np.asarray(leaf), mesh)


def stackable(module: str, leaf: Any) -> bool:
    """Whether `leaf` is an MoE matrix held one QuantizedWeight per expert (what stack_experts takes)."""
    return isinstance(leaf, ExpertStack) and isinstance(leaf.experts[0], QuantizedWeight)


def relayout(leaf: Any, moe: str) -> bool:
    """Whether experts_layout changes `leaf`."""
    return stackable("", leaf) or (isinstance(leaf, GroupedWeight) and pads(leaf, moe))


def experts_layout(leaf: Any, moe: str) -> Any:
    """An MoE matrix (per-expert or stacked) as the grouped form `moe` reads it (stack_experts, then
    grouped.kernel_layout); other leaves unchanged."""
    if stackable("", leaf):
        leaf = stack_experts(leaf)
    return kernel_layout(leaf, moe) if isinstance(leaf, GroupedWeight) else leaf


class PaddedExperts:
    """An MoE matrix's host or file array [E, K, N] with grouped.kernel_layout's zeros, each expert padded when it
    is asked for (stacking.write_pieces reads one at a time): `per` > 0 pads each of `blocks` row blocks of K to
    `per` rows, else `cols` pads N to `cols` columns. The whole padded matrix never exists on the host."""

    def __init__(self, source: Any, blocks: int, per: int = 0, cols: int = 0) -> None:
        e, k, n = source.shape
        self.source, self.blocks, self.per, self.cols = source, blocks, per, cols
        self.shape, self.dtype = (e, blocks * per if per else k, cols or n), np.dtype(source.dtype)

    def __getitem__(self, e: int) -> np.ndarray:
        one = np.asarray(self.source[e])
        k, n = one.shape
        if self.per:
            return np.pad(one.reshape(self.blocks, k // self.blocks, n),
                          ((0, 0), (0, self.per - k // self.blocks), (0, 0))).reshape(-1, n)
        return np.pad(one, ((0, 0), (0, self.cols - n)))


def lazy_kernel_layout(leaf: Any, moe: str) -> Any:
    """grouped.kernel_layout(leaf, moe) for a host GroupedWeight whose arrays may be file_arrays.FileArrays,
    padded expert by expert as they are read (PaddedExperts); other leaves unchanged."""
    if not (isinstance(leaf, GroupedWeight) and pads(leaf, moe)):
        return leaf
    _, k, n = leaf.weight.shape
    if leaf.blocks > 1:
        per = k // leaf.blocks
        return GroupedWeight(PaddedExperts(leaf.weight, leaf.blocks, per=per + -per % ALIGN), leaf.scales, rows=k)
    cols = n + -n % ALIGN
    return GroupedWeight(PaddedExperts(leaf.weight, 1, cols=cols), PaddedExperts(leaf.scales, 1, cols=cols), cols=n)


def stack_experts(leaf: ExpertStack) -> GroupedWeight:
    """An MoE matrix's per-expert QuantizedWeights (host arrays) -> one GroupedWeight [E, K, N] in the
    checkpoint's layout (to_internal(stacked=True)'s form)."""
    weights = [np.swapaxes(q.weight, -1, -2) if q.transposed else q.weight for q in leaf.experts]
    return GroupedWeight(np.stack(weights, axis=-3),
                         np.stack([np.asarray(q.scales, np.float32) for q in leaf.experts], axis=-3))


EMB_STD = 0.002
_DRAW_ROWS = 256  # leading rows of a random array drawn by one generator, one thread at a time
_THREADED_BYTES = 32 << 20  # arrays from this size are drawn on a pool of threads (smaller: the threads' arenas
# kept more host memory than they saved time: tests/test_build_memory.py)


def _threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def draw_rows(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any,
              draw: Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]) -> np.ndarray:
    """An array of `shape` whose leading rows are drawn _DRAW_ROWS at a time, each block by its own child of `rng`
    (Generator.spawn, in block order), on a pool of threads for large arrays: numpy's generators fill without the
    GIL, so a host's cores share the work (Grok-1 width's random table and experts took ~50 s on one core). The
    values depend only on `rng` and `shape`, not on the number of threads."""
    out = np.empty(shape, dtype)
    starts = range(0, shape[0], _DRAW_ROWS)
    children = rng.spawn(len(starts))

    def fill(block: int) -> None:
        start = starts[block]
        stop = min(start + _DRAW_ROWS, shape[0])
        out[start:stop] = draw(children[block], (stop - start, *shape[1:]))

    if len(starts) == 1 or out.nbytes < _THREADED_BYTES:
        for block in range(len(starts)):
            fill(block)
    else:
        with concurrent.futures.ThreadPoolExecutor(min(_threads(), len(starts))) as pool:
            list(pool.map(fill, range(len(starts))))
    return out


def _int8(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(-127, 128, shape, dtype=np.int8)


def _random_scales(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """bfloat16 scales [..., blocks, N] giving the int8 matrix a std of gain / sqrt(K)."""
    gain = 3.0 if spec.module.endswith(("query", "key")) else 1.0
    target = gain / np.sqrt(spec.shape[-2]) / UNIFORM_INT8_STD
    return rng.uniform(0.9 * target, 1.1 * target, spec.scales_shape).astype(ml_dtypes.bfloat16)


def random_experts(spec: TensorSpec, rng: np.random.Generator) -> tuple[np.ndarray, Iterator[np.ndarray]]:
    """An MoE matrix's random scales [E, blocks, N] and, drawn lazily one expert after the other, its int8
    weights [K, N]: a loader can pack and free each before the next is drawn."""
    scales = _random_scales(spec, rng)
    return scales, (draw_rows(rng, spec.shape[1:], np.int8, _int8) for _ in range(spec.shape[0]))


def _random_table(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """N(0, EMB_STD) in bfloat16, the type the released checkpoint stores its embedding table in (drawn in float32
    a block of rows at a time, not as one float32 table)."""
    return draw_rows(rng, shape, ml_dtypes.bfloat16, lambda g, rows: (g.standard_normal(rows, dtype=np.float32)
                                                                       * EMB_STD).astype(ml_dtypes.bfloat16))


def random_leaf(spec: TensorSpec, cfg: ModelConfig, rng: np.random.Generator) -> Any:
    """Random weights in checkpoint layout, scaled so outputs vary (logit std ~2), like golden's recipe. An MoE
    matrix draws its scales first, then its experts one by one (random_experts: the same values)."""
    d = cfg.model.emb_size
    emb_std = EMB_STD
    if spec.quantized and len(spec.shape) == 3:
        scales, weights = random_experts(spec, rng)
        stack = np.empty(spec.shape, np.int8)  # each expert drawn into its place: no list stacked into a copy
        for e, weight in enumerate(weights):
            stack[e] = weight
        return stack, scales
    if spec.quantized:  # int8 drawn directly (fast even for large configs), scales give std gain/sqrt(K)
        weight = draw_rows(rng, spec.shape, np.int8, _int8)
        return weight, _random_scales(spec, rng)
    if spec.module == EMBED:
        return _random_table(spec.shape, rng)
    if spec.module == FINAL_NORM:
        target = 2.0 / (cfg.output_multiplier_scale * emb_std * np.sqrt(d))
        return rng.uniform(0.75 * target, 1.25 * target, spec.shape).astype(np.float32)
    if spec.name == "w":  # router
        return rng.standard_normal(spec.shape, dtype=np.float32) * (2.0 / np.sqrt(d))
    low, high = (0.5, 1.5) if spec.module.endswith(("rms_norm", "rms_norm_2")) else (1.0, 3.0)
    return rng.uniform(low, high, spec.shape).astype(np.float32)


def set_leaf(params: Params, spec: TensorSpec, value: Any) -> None:
    params.setdefault(spec.module, {})[spec.name] = value
