"""Partition rules as data (regex over parameter paths -> PartitionSpec) and the (data, expert, model) device mesh.

Weights are split over the `model` axis (heads, expert hidden units, embedding features) and replicated over
`data`; the stacked experts (weights.GroupedWeight) are also split over `expert`, each expert group holding
num_experts / expert whole experts (model/expert_parallel.py computes them there). Activations and KV memory put
the batch on `data` and heads/features on `model`. A rule whose axis does not divide a dimension falls back to
replicating that dimension, so every mesh that passes `validate` works. Every mesh has the three axes (an unused
one has size 1), so the rules name them freely.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model_service.config import ConfigError, MeshConfig

log = logging.getLogger(__name__)

DATA = "data"
EXPERT = "expert"
MODEL = "model"
AXES = (DATA, EXPERT, MODEL)

# The stacked MoE matrices' specs, keyed by (matrix, leaf): each expert on one expert group, its hidden units split
# over `model` (linear_1's 8 row-block scales with its rows: config.validate asks the model axis to divide 8).
EXPERT_SPECS: dict[tuple[str, str], P] = {
    ("linear", "weight"): P(EXPERT, None, MODEL),  # [E, D, F]
    ("linear", "scales"): P(EXPERT, None, MODEL),  # [E, 1, F]
    ("linear_v", "weight"): P(EXPERT, None, MODEL),
    ("linear_v", "scales"): P(EXPERT, None, MODEL),
    ("linear_1", "weight"): P(EXPERT, MODEL, None),  # [E, F, D]
    ("linear_1", "scales"): P(EXPERT, MODEL, None),  # [E, 8, D]
}

# Paths are "<haiku module>/<param>[/weight|/scales]"; int8 layouts as in layers.QuantizedWeight.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"multi_head_attention/(query|key|value)/w/weight$", P(MODEL, None)),  # [N=heads*D, K]
    (r"multi_head_attention/(query|key|value)/w/scales$", P(None, MODEL)),  # [1, N]
    (r"multi_head_attention/linear/w/weight$", P(MODEL, None)),  # [K=heads*D, D] (row-parallel, not transposed)
    (r"multi_head_attention/linear/w/scales$", P(None, None)),  # [8, D]
    # MoE matrices are one QuantizedWeight per expert (layers.ExpertStack): paths end experts/<e>/... (packed on
    # one device: one stack of every expert, at experts/0)
    (r"moe/(linear|linear_v)/w/experts/[0-9]+/weight$", P(MODEL, None)),  # [F, D]
    (r"moe/(linear|linear_v)/w/experts/[0-9]+/scales$", P(None, MODEL)),  # [1, F]
    (r"moe/linear_1/w/experts/[0-9]+/weight$", P(MODEL, None)),  # [F, D] (row-parallel, not transposed)
    (r"moe/linear_1/w/experts/[0-9]+/scales$", P(None, None)),  # [8, D]
    # Stacked experts (weights.GroupedWeight, the checkpoint's [E, K, N] layout): experts over `expert`
    *((r"moe/" + name + "/w/" + leaf + "$", spec) for (name, leaf), spec in EXPERT_SPECS.items()),
    # The same matrices packed for the native kernel (packed.PackedWeight): [S*NB, K, 16] / [blocks, S*NB*16].
    (r"(multi_head_attention/(query|key|value)/w|moe/(linear|linear_v)/w/experts/[0-9]+)/packed$",
     P(MODEL, None, None)),  # columns (N) split
    (r"(multi_head_attention/(query|key|value)/w|moe/(linear|linear_v)/w/experts/[0-9]+)/packed_scales$",
     P(None, MODEL)),
    (r"(multi_head_attention/linear/w|moe/linear_1/w/experts/[0-9]+)/packed$", P(None, MODEL, None)),  # rows (K)
    (r"(multi_head_attention/linear/w|moe/linear_1/w/experts/[0-9]+)/packed_scales$", P(MODEL, None)),
    (r"in_out_embed/embeddings/packed$", P(None, MODEL, None)),  # [V/16, D, 16]: features split, as unpacked
    (r"in_out_embed/embeddings/packed_scales$", P(MODEL, None)),  # an int8 table's [D / 32, V]: features split
    (r"router/w$", P(None, None)),
    (r"rms_norm(_[0-9]+)?/scale$", P(None)),
    (r"in_out_embed/embeddings$", P(None, MODEL)),  # [V, D]
)

# The scanned decoder layers (model/transformer.py, Backend.scan_layers) keep every layer's parameter in one array
# under this module, the layer axis leading and unsharded: their rules are the per-layer ones above, shifted by it.
LAYER_STACK = "transformer/decoder_layers/"

# A dense prefill's KV [N, Hkv, T, D]; the paged pool [blocks + 1, Hkv, block_size, D] (every data shard reads
# any slot's blocks); per-slot positions [B].
KV_SPEC = P(DATA, MODEL, None, None)
POOL_SPEC = P(None, MODEL, None, None)
TOKEN_POOL_SPEC = P(None, None, MODEL)  # the accelerators' pool [blocks + 1, block_size, Hkv * D]: heads major
POSITIONS_SPEC = P(DATA)


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None,
              between_hosts: MeshConfig | None = None) -> Mesh:
    """A (data, expert, model) mesh with Auto axis types over the first data*expert*model devices.

    A mesh over every device is laid out by mesh_utils.create_device_mesh (on a TPU slice: along its ICI
    torus). When JAX spans several processes (jax.distributed), pass `between_hosts`: see `make_multihost_mesh`.
    """
    if between_hosts is not None and jax.process_count() > 1:
        return make_multihost_mesh(mesh_cfg, between_hosts)
    devices = list(devices if devices is not None else jax.devices())
    if mesh_cfg.size > len(devices):
        raise ConfigError(f"mesh {mesh_cfg} needs {mesh_cfg.size} devices but only "
                          f"{len(devices)} are visible (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    shape = (mesh_cfg.data, mesh_cfg.expert, mesh_cfg.model)
    grid = along_links(shape, devices) if mesh_cfg.size == len(devices) else None
    if grid is None:
        grid = np.array(devices[: mesh_cfg.size]).reshape(shape)
    return Mesh(grid, AXES)


def along_links(shape: tuple[int, ...], devices: Sequence[Any]) -> np.ndarray | None:
    """mesh_utils.create_device_mesh's layout of every device (on a TPU slice: along its ICI torus, splitting a
    torus axis over two mesh axes where the shape needs it, e.g. 2,8 on a 4x4 slice); None for a shape it
    cannot lay out, whose caller keeps the devices' own order."""
    for split in (False, True):
        try:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split)
        except (ValueError, NotImplementedError, AssertionError) as e:
            error = e
    log.warning("the mesh is not laid along the device links", extra={"shape": list(shape), "error": str(error)})
    return None


def local_mesh_shape(mesh_cfg: MeshConfig, between_hosts: MeshConfig) -> MeshConfig:
    """The per-process mesh: the global mesh divided axis by axis by the between-hosts layout."""
    if mesh_cfg.data % between_hosts.data or mesh_cfg.model % between_hosts.model:
        raise ConfigError(f"between-hosts layout {between_hosts.data},{between_hosts.model} must divide the mesh "
                          f"{mesh_cfg.data},{mesh_cfg.model} axis by axis (e.g. mesh 1,8 over 2 processes: 1,2)")
    return MeshConfig(mesh_cfg.data // between_hosts.data, mesh_cfg.model // between_hosts.model)


def default_between_hosts(mesh_cfg: MeshConfig, processes: int) -> MeshConfig:
    """Spread the processes over the data axis when they divide it (only the batch crosses hosts), else over
    the expert and model axes (one replica's weights span hosts, as the test mesh 1,8 over 2 processes needs)."""
    if mesh_cfg.data % processes == 0:
        return MeshConfig(processes, 1)
    if mesh_cfg.expert * mesh_cfg.model % processes == 0:
        return MeshConfig(1, processes)
    raise ConfigError(f"{processes} processes divide neither axis of the mesh {mesh_cfg.data},{mesh_cfg.model}: "
                      "pass --between-hosts DATA,MODEL explicitly")


def make_multihost_mesh(mesh_cfg: MeshConfig, between_hosts: MeshConfig) -> Mesh:
    """The global mesh of a multi-process JAX job over every device of the job: see `multihost_grid`."""
    grid = multihost_grid(mesh_cfg, between_hosts, jax.devices())
    return Mesh(grid.reshape(mesh_cfg.data, mesh_cfg.expert, mesh_cfg.model), AXES)


def joined_by(devices: Sequence[Any]) -> str:
    """How a multi-process job's devices are connected: "slice" (one TPU slice: every chip on the same ICI
    network, whatever host it hangs off), "slices" (TPU slices joined over the data-center network) or
    "processes" (hosts joined by a network: CPU processes over gloo, GPU hosts)."""
    if all(d.platform == "tpu" for d in devices):
        return "slice" if len({getattr(d, "slice_index", 0) for d in devices}) == 1 else "slices"
    return "processes"


def multihost_grid(mesh_cfg: MeshConfig, between_hosts: MeshConfig, devices: Sequence[Any]) -> np.ndarray:
    """[data, expert * model] devices of a multi-process job (make_multihost_mesh cuts the second axis into
    expert groups of `model` devices; the between-hosts layout's MODEL spans expert and model).

    One TPU slice is one mesh over all its devices, laid along its ICI torus (mesh_utils.create_device_mesh):
    its hosts are not network hops, so they need not own blocks. Slices over the data-center network, and
    processes joined by a network, are the granules of a hybrid mesh (like the reference's
    make_mesh(local_mesh_config, between_hosts_config)): each granule's devices form one block and the
    blocks are tiled in granule order, so collectives inside a block stay off the slow network. Processes
    tile as `between_hosts` says; slices as it says when there are as many slices as processes, else as
    `default_between_hosts` spreads them.
    """
    kind = joined_by(devices)
    mesh_cfg = MeshConfig(mesh_cfg.data, mesh_cfg.expert * mesh_cfg.model)
    if mesh_cfg.size != len(devices):
        raise ConfigError(f"mesh {mesh_cfg.data},{mesh_cfg.model} has {mesh_cfg.size} devices but the job has "
                          f"{len(devices)}: a multi-process mesh spans every device (on CPU set XLA_FLAGS="
                          "--xla_force_host_platform_device_count=N per process)")
    grid = along_links((mesh_cfg.data, mesh_cfg.model), devices) if kind == "slice" else None
    if grid is not None:
        return grid
    kind = "processes" if kind == "slice" else kind
    granules = len({d.slice_index if kind == "slices" else d.process_index for d in devices})
    if kind == "slices" and between_hosts.size != granules:
        between_hosts = default_between_hosts(mesh_cfg, granules)
    local = local_mesh_shape(mesh_cfg, between_hosts)
    if between_hosts.size != granules:
        raise ConfigError(f"between-hosts layout {between_hosts.data},{between_hosts.model} has "
                          f"{between_hosts.size} blocks but the job has {granules} processes")
    if local.size * granules != len(devices):
        raise ConfigError(f"mesh {mesh_cfg.data},{mesh_cfg.model} over {between_hosts.data},{between_hosts.model} "
                          f"processes needs {local.size} devices per process but the processes have "
                          f"{len(devices) / granules:g} (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return mesh_utils.create_hybrid_device_mesh((local.data, local.model), (between_hosts.data, between_hosts.model),
                                                devices=devices, process_is_granule=kind == "processes",
                                                allow_split_physical_axes=True)


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
    """The first rule matching `path`; unmatched parameters are replicated. Under LAYER_STACK the rule's spec
    follows a leading unsharded layer axis."""
    spec = next((spec for pattern, spec in rules if re.search(pattern, path)), P())
    return P(None, *spec) if path.startswith(LAYER_STACK) else spec


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
