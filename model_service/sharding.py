"""Partition rules as data (regex over parameter paths -> PartitionSpec) and the (data, model) device mesh.

Weights are split over the `model` axis (heads, expert hidden units, embedding features) and replicated over
`data`; activations and KV memory put the batch on `data` and heads/features on `model`. A rule whose axis does
not divide a dimension falls back to replicating that dimension, so every mesh that passes `validate` works.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model_service.config import ConfigError, MeshConfig

DATA = "data"
MODEL = "model"

# Paths are "<haiku module>/<param>[/weight|/scales]"; int8 layouts as in layers.QuantizedWeight.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"multi_head_attention/(query|key|value)/w/weight$", P(MODEL, None)),  # [N=heads*D, K]
    (r"multi_head_attention/(query|key|value)/w/scales$", P(None, MODEL)),  # [1, N]
    (r"multi_head_attention/linear/w/weight$", P(MODEL, None)),  # [K=heads*D, D] (row-parallel, not transposed)
    (r"multi_head_attention/linear/w/scales$", P(None, None)),  # [8, D]
    # MoE matrices are one QuantizedWeight per expert (layers.ExpertStack): paths end experts/<e>/...
    (r"moe/(linear|linear_v)/w/experts/[0-9]+/weight$", P(MODEL, None)),  # [F, D]
    (r"moe/(linear|linear_v)/w/experts/[0-9]+/scales$", P(None, MODEL)),  # [1, F]
    (r"moe/linear_1/w/experts/[0-9]+/weight$", P(MODEL, None)),  # [F, D] (row-parallel, not transposed)
    (r"moe/linear_1/w/experts/[0-9]+/scales$", P(None, None)),  # [8, D]
    (r"router/w$", P(None, None)),
    (r"rms_norm(_[0-9]+)?/scale$", P(None)),
    (r"in_out_embed/embeddings$", P(None, MODEL)),  # [V, D]
)

# KV memory [B, Hkv, S, D] and per-slot positions [B].
KV_SPEC = P(DATA, MODEL, None, None)
POSITIONS_SPEC = P(DATA)


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh with Auto axis types over the first data*model devices."""
    devices = list(devices if devices is not None else jax.devices())
    if mesh_cfg.size > len(devices):
        raise ConfigError(f"mesh {mesh_cfg.data},{mesh_cfg.model} needs {mesh_cfg.size} devices but only "
                          f"{len(devices)} are visible (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    grid = np.array(devices[: mesh_cfg.size]).reshape(mesh_cfg.data, mesh_cfg.model)
    return Mesh(grid, (DATA, MODEL))


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Drop the mesh axes of `spec` that do not evenly divide their dimension of `shape`."""
    entries: list[Any] = list(spec) + [None] * (len(shape) - len(spec))
    out: list[Any] = []
    for dim, entry in zip(shape, entries[: len(shape)]):
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        out.append(entry if names and dim % size == 0 else None)
    return P(*out)


def spec_for_path(path: str, rules: Sequence[tuple[str, P]] = PARAM_RULES) -> P:
    """The first rule matching `path`; unmatched parameters are replicated."""
    for pattern, spec in rules:
        if re.search(pattern, path):
            return spec
    return P()


def path_to_str(path: tuple[Any, ...]) -> str:
    """A jax key path as "a/b/c" (dict keys and NamedTuple field names)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
    return "/".join(parts)


def params_shardings(params: Any, mesh: Mesh) -> Any:
    """A pytree of NamedSharding matching `params` (arrays or ShapeDtypeStructs)."""
    def one(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        return NamedSharding(mesh, fit_spec(spec_for_path(path_to_str(path)), leaf.shape, mesh))
    return jax.tree_util.tree_map_with_path(one, params)


def named(mesh: Mesh, spec: P, shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, fit_spec(spec, shape, mesh))


def constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """with_sharding_constraint that tolerates dimensions the mesh axes do not divide."""
    if mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, named(mesh, spec, x.shape))
