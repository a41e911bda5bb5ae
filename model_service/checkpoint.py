"""Read and write the released Grok-1 checkpoint format safely.

Format: `<dir>/ckpt-0/tensor{i:05d}_000`, one pickle per leaf of TrainingState(params=...) in tree-flatten
order; int8 matrices as `__main__.QuantizedWeight8bit` (int8 `weight` + bfloat16 `scales`), the rest numpy
float32 arrays, written by numpy 1.x (`numpy.core.multiarray._reconstruct`).

Each file is read by tensor_file.py's restricted unpickler (only arrays, dtypes and the quantized-weight
record; sizes checked against the file and the config before anything is read or allocated; every error
names the file). Each tensor goes straight onto its sharding, and `load_params` reads from disk only the
regions of each array that this process's devices hold (file_arrays.FileArray), in large reads straight into
the device shards (shard_reads.py): with one replica spread over several processes, no process reads the whole
checkpoint, and none holds a tensor's host copy beside its shards.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding

from model_service.config import ModelConfig
from model_service.file_arrays import FileArray
from model_service.model.grouped import kernel_layout, pads
from model_service.model.params import Params, TensorSpec, lazy_kernel_layout, pack_for_native, random_experts, \
    random_leaf, set_leaf, tensor_specs, to_internal
from model_service.model.stacking import put_layer, put_layer_pieces
from model_service.model.weights import ExpertStack, GroupedWeight, QuantizedWeight
from model_service.shard_reads import aligned_empty, place_file_array
from model_service.sharding import fit_spec, path_to_str, spec_for_path
from model_service.tensor_file import (  # noqa: F401 - CheckpointError and read_tensor are this module's API too
    BASIC_DTYPE_CODES, CheckpointError, read_bounded, read_tensor, tensor_max_bytes)

Progress = Callable[[int, int], None]
_MANIFEST_MAX_BYTES = 16 << 20

# ---- writing: emits the same opcodes numpy 1.x produces for arrays, so older readers load it too ----

def _op_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _op_int(v: int) -> bytes:
    return b"J" + struct.pack("<i", v)


def _op_str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _op_bytes(raw: bytes) -> bytes:
    return b"\x8e" + struct.pack("<Q", len(raw)) + raw


def _op_tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _encode_dtype(dt: np.dtype) -> bytes:
    if dt == np.dtype(ml_dtypes.bfloat16):
        spec, state = _op_global("ml_dtypes", "bfloat16"), [_op_int(3), _op_str("<"), b"NNN",
                                                           _op_int(2), _op_int(2), _op_int(80)]
    else:
        code = dt.str[1:]
        if code not in BASIC_DTYPE_CODES:
            raise CheckpointError(f"cannot write dtype {dt}")
        spec, state = _op_str(code), [_op_int(3), _op_str(dt.str[0]), b"NNN", _op_int(-1), _op_int(-1), _op_int(0)]
    return _op_global("numpy", "dtype") + spec + b"\x89\x88\x87R" + _op_tuple(state) + b"b"


def _encode_array(arr: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(arr)
    head = _op_global("numpy.core.multiarray", "_reconstruct") + _op_global("numpy", "ndarray")
    head += _op_tuple([_op_int(0)]) + b"C\x01b\x87R"
    state = [_op_int(1), _op_tuple([_op_int(d) for d in arr.shape]), _encode_dtype(arr.dtype), b"\x89",
             _op_bytes(arr.tobytes())]
    return head + _op_tuple(state) + b"b"


def encode_tensor(leaf: Any) -> bytes:
    """A numpy array, or (int8 weight, bfloat16 scales), as a protocol-4 pickle in the released layout."""
    if isinstance(leaf, tuple):
        weight, scales = leaf
        body = _op_global("__main__", "QuantizedWeight8bit") + b")\x81}(" + _op_str("weight") + \
            _encode_array(weight) + _op_str("scales") + _encode_array(scales) + b"ub"
    else:
        body = _encode_array(np.asarray(leaf))
    return b"\x80\x04" + body + b"."


def write_checkpoint(out_dir: pathlib.Path | str, cfg: ModelConfig, leaves: Any, progress: Progress | None = None) -> None:
    """Write checkpoint-layout leaves (an iterable in tensor_specs order) plus a manifest.json."""
    ckpt = pathlib.Path(out_dir) / "ckpt-0"
    ckpt.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(cfg)
    manifest = []
    for i, (spec, leaf) in enumerate(zip(specs, leaves, strict=True)):
        (ckpt / f"tensor{i:05d}_000").write_bytes(encode_tensor(leaf))
        manifest.append({"index": i, "name": spec.ckpt_path, "kind": "QuantizedWeight8bit" if spec.quantized
                         else "ndarray", "shape": list(spec.shape)})
        if progress:
            progress(i + 1, len(specs))
    (pathlib.Path(out_dir) / "manifest.json").write_text(json.dumps({"tensors": manifest}, indent=1))


# ---- loading onto the mesh ----

def _check_layout(ckpt: pathlib.Path, specs: list[TensorSpec]) -> None:
    if not ckpt.is_dir():
        raise CheckpointError(f"no checkpoint directory {ckpt} (expected <dir>/ckpt-0/tensor00000_000 ...)")
    found = sorted(p.name for p in ckpt.glob("tensor*_000"))
    expected = [f"tensor{i:05d}_000" for i in range(len(specs))]
    manifest_path = ckpt.parent / "manifest.json"
    if manifest_path.is_file():
        try:
            manifest = json.loads(read_bounded(manifest_path, _MANIFEST_MAX_BYTES))
            names = [t["name"] for t in manifest.get("tensors", [])]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{manifest_path}: not a checkpoint manifest ({type(e).__name__}: {e})") from None
        want = [s.ckpt_path for s in specs]
        if names != want:
            raise CheckpointError(f"checkpoint parameters do not match the model config.\n"
                                  f"Params missing in checkpoint: {sorted(set(want) - set(names))}\n"
                                  f"Params missing in code: {sorted(set(names) - set(want))}")
    if found != expected:
        missing = [f"{n} ({s.ckpt_path})" for n, s in zip(expected, specs) if n not in set(found)]
        extra = sorted(set(found) - set(expected))
        raise CheckpointError(f"checkpoint {ckpt} has {len(found)} tensors, the config expects {len(specs)}.\n"
                              f"Params missing in checkpoint: {missing}\nTensors missing in code: {extra}")


def _check_leaf(spec: TensorSpec, leaf: Any, index: int) -> None:
    if spec.quantized:
        ok = isinstance(leaf, tuple) and leaf[0].shape == spec.shape and leaf[1].shape == spec.scales_shape \
            and leaf[0].dtype == np.int8
        got = f"{leaf[0].shape}/{leaf[1].shape} {leaf[0].dtype}" if isinstance(leaf, tuple) else f"array {leaf.shape}"
        want = f"QuantizedWeight8bit int8 {spec.shape} with scales {spec.scales_shape}"
    else:
        ok = not isinstance(leaf, tuple) and leaf.shape == spec.shape
        got = f"QuantizedWeight8bit {leaf[0].shape}" if isinstance(leaf, tuple) else f"array {leaf.shape}"
        want = f"array {spec.shape}"
    if not ok:
        raise CheckpointError(f"tensor{index:05d}_000 ({spec.ckpt_path}): checkpoint has {got}, the config expects {want}")


def _sharding(shape: tuple[int, ...], mesh: Mesh, path: str) -> NamedSharding:
    return NamedSharding(mesh, fit_spec(spec_for_path(path), shape, mesh))


def _place(arr: np.ndarray | FileArray, mesh: Mesh, path: str) -> jax.Array:
    sharding = _sharding(arr.shape, mesh, path)
    if isinstance(arr, FileArray):  # read from disk straight into this process's shards (shard_reads.py)
        return place_file_array(arr, sharding)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def place_leaf(spec: TensorSpec, internal: Any, mesh: Mesh) -> Any:
    """Put every array of one parameter (plain, QuantizedWeight or ExpertStack) onto its sharding."""
    base = f"{spec.module}/{spec.name}"

    def put(path: tuple[Any, ...], arr: np.ndarray) -> jax.Array:
        sub = path_to_str(path)
        return _place(arr, mesh, f"{base}/{sub}" if sub else base)

    return jax.tree_util.tree_map_with_path(put, internal)


def _placed(spec: TensorSpec, internal: Any, mesh: Mesh, pack: bool, int8_table: bool = False) -> Any:
    """One parameter on its devices. With native products each matrix is packed on the host first, straight
    from its source (a checkpoint FileArray is read slab by slab), and an MoE matrix expert by expert, each
    placed (on one device: into the matrix's stack) before the next is packed: the host holds at most one packed
    expert besides what is placed.
    `int8_table`: the table rounded to int8 as it is packed (int8 activations, packed.pack_table)."""
    if not pack:
        return place_leaf(spec, internal, mesh)
    if isinstance(internal, ExpertStack):
        return _placed_experts(spec, internal.experts, len(internal.experts), mesh, pack)
    return place_leaf(spec, pack_for_native(spec.module, internal, mesh, int8_table), mesh)


def _placed_experts(spec: TensorSpec, experts: Iterable[QuantizedWeight], count: int, mesh: Mesh,
                    pack: bool) -> ExpertStack:
    """An MoE matrix's `count` experts on their devices, taken one at a time from `experts`: with native products
    on one device one stack of them all, else one placed matrix per expert."""
    if pack and mesh.size == 1:
        return _stacked_experts(spec, (pack_for_native(spec.module, q, mesh) for q in experts), count, mesh)
    return ExpertStack(tuple(_placed_expert(spec, e, pack_for_native(spec.module, q, mesh) if pack else q, mesh)
                             for e, q in enumerate(experts)))


def _stacked_experts(spec: TensorSpec, packed: Iterable[Any], count: int, mesh: Mesh) -> ExpertStack:
    """The packed experts of one MoE matrix as one stack on the single device (layers.ExpertStack). Each expert is
    copied into a host stack as it is packed, and the device array is that host memory itself (a CPU device
    reads host memory: JAX aliases a 64-byte aligned array instead of copying it), so the host holds at most one
    packed expert besides the stack, and no matrix is ever held twice."""
    first: Any = None  # the first expert's PackedWeight without its arrays: what the stack's one is like
    for e, q in enumerate(packed):
        if first is None:
            first = dataclasses.replace(q, packed=None, packed_scales=None)
            weights = aligned_empty((count, *q.packed.shape), q.packed.dtype)
            scales = aligned_empty((count, *q.packed_scales.shape), q.packed_scales.dtype)
        weights[e], scales[e] = q.packed, q.packed_scales
    base = f"{spec.module}/{spec.name}/experts/0"
    return ExpertStack((dataclasses.replace(
        first, packed=jax.device_put(weights, _sharding(weights.shape, mesh, f"{base}/packed"), may_alias=True),
        packed_scales=jax.device_put(scales, _sharding(scales.shape, mesh, f"{base}/packed_scales"), may_alias=True)),))


def _placed_expert(spec: TensorSpec, e: int, leaf: Any, mesh: Mesh) -> Any:
    """Expert e's matrix on its devices, under the partition rules' expert paths (…/w/experts/<e>/...)."""
    base = f"{spec.module}/{spec.name}/experts/{e}"
    return jax.tree_util.tree_map_with_path(lambda path, arr: _place(arr, mesh, f"{base}/{path_to_str(path)}"), leaf)


def _keep(params: Params, spec: TensorSpec, placed: Any, cfg: ModelConfig, mesh: Mesh, stack_layers: bool) -> None:
    """One placed parameter into `params`: under its own module, or (`stack_layers`) into its layer stack."""
    if not (stack_layers and put_layer(params, spec.module, spec.name, placed, cfg.model.num_layers, mesh)):
        set_leaf(params, spec, placed)


def _put(params: Params, spec: TensorSpec, internal: Any, cfg: ModelConfig, mesh: Mesh, pack: bool,
         int8_table: bool, stack_layers: bool, moe: str = "") -> None:
    """One parameter's host form (to_internal's) onto the devices and into `params`. Unpacked into a layer stack it
    goes a piece at a time straight into the stack (stacking.put_layer_pieces: no placed copy of the whole
    tensor beside it); otherwise placed (packed first with `pack`), then kept. A stacked MoE matrix is laid out
    for `moe` (grouped.kernel_layout's padding) as it loads, not copied into that layout once loaded."""
    if stack_layers and not pack and put_layer_pieces(params, spec.module, spec.name, lazy_kernel_layout(internal, moe),
                                                      cfg.model.num_layers, mesh):
        return
    if isinstance(internal, GroupedWeight) and pads(internal, moe):
        internal = kernel_layout(GroupedWeight(np.asarray(internal.weight), np.asarray(internal.scales)), moe)
    _keep(params, spec, _placed(spec, internal, mesh, pack, int8_table), cfg, mesh, stack_layers)


def load_params(ckpt_dir: str, cfg: ModelConfig, mesh: Mesh, dtype: Any, progress: Progress | None = None,
                pack: bool = False, int8_table: bool = False, stacked: bool = False,
                stack_layers: bool = False, moe: str = "") -> Params:
    """Read `<ckpt_dir>/ckpt-0` into sharded device arrays, one tensor at a time (`pack`: the matrices packed
    for native products, as GrokModel.pack_params would, and the table kept in the checkpoint's type, or with
    `int8_table` rounded to int8; `stacked`: each MoE matrix's experts in one buffer, Backend.stacked_experts;
    `stack_layers`: each layer's tensor written into its parameter's stack as it is placed,
    Backend.scan_layers; `moe`: stacked experts laid out as that MoE form reads them, Backend.moe)."""
    specs = tensor_specs(cfg)
    ckpt = pathlib.Path(ckpt_dir) / "ckpt-0"
    _check_layout(ckpt, specs)
    params: Params = {}
    for i, spec in enumerate(specs):
        leaf = read_tensor(ckpt / f"tensor{i:05d}_000", lazy=True, max_bytes=tensor_max_bytes(spec), root=ckpt)
        _check_leaf(spec, leaf, i)
        _put(params, spec, to_internal(spec, leaf, dtype, native=pack, stacked=stacked), cfg, mesh, pack, int8_table,
             stack_layers, moe)
        if progress:
            progress(i + 1, len(specs))
    return params


def random_leaves(cfg: ModelConfig, seed: int) -> Any:
    """Random checkpoint-layout leaves in file order (numpy PCG64 seeded with `seed`)."""
    rng = np.random.default_rng(seed)
    return (random_leaf(spec, cfg, rng) for spec in tensor_specs(cfg))


def random_params(cfg: ModelConfig, mesh: Mesh, dtype: Any, seed: int, pack: bool = False,
                  int8_table: bool = False, stacked: bool = False, stack_layers: bool = False, moe: str = "") -> Params:
    """Random int8-quantized weights, laid out and sharded exactly like a loaded checkpoint of
    `random_leaves(cfg, seed)`; an MoE matrix is drawn, converted and placed one expert at a time (`stacked`:
    drawn whole and placed as one buffer, as load_params(stacked=True); `stack_layers` and `moe` as load_params')."""
    rng = np.random.default_rng(seed)
    params: Params = {}
    for spec in tensor_specs(cfg):
        if spec.quantized and len(spec.shape) == 3 and stacked:
            _put(params, spec, to_internal(spec, _random_stacked(spec, rng), dtype, stacked=True), cfg, mesh, pack,
                 int8_table, stack_layers, moe)
        elif spec.quantized and len(spec.shape) == 3 and stack_layers and not pack:
            _put(params, spec, _random_expert_stack(spec, rng), cfg, mesh, pack, int8_table, stack_layers)
        elif spec.quantized and len(spec.shape) == 3:
            _keep(params, spec, _random_experts(spec, rng, mesh, pack), cfg, mesh, stack_layers)
        else:
            _put(params, spec, to_internal(spec, random_leaf(spec, cfg, rng), dtype, native=pack), cfg, mesh, pack,
                 int8_table, stack_layers)
    return params


def _random_stacked(spec: TensorSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """random_leaf's (weight [E, K, N], scales) for an MoE matrix, each expert drawn straight into its place (no
    list of experts stacked into a second copy)."""
    scales, weights = random_experts(spec, rng)
    weight = aligned_empty(spec.shape, np.int8)
    for e, drawn in enumerate(weights):
        weight[e] = drawn
    return weight, scales


def _host_experts(spec: TensorSpec, rng: np.random.Generator) -> Iterator[QuantizedWeight]:
    """random_leaf's values for an MoE matrix (random_experts) in to_internal's per-expert form, each expert drawn
    when it is asked for."""
    scales, weights = random_experts(spec, rng)
    return (QuantizedWeight(weight.swapaxes(-1, -2) if spec.blocks == 1 else weight, scales[e].astype(np.float32))
            for e, weight in enumerate(weights))


def _random_experts(spec: TensorSpec, rng: np.random.Generator, mesh: Mesh, pack: bool) -> ExpertStack:
    """random_leaf's values for an MoE matrix, each expert placed before the next is drawn."""
    return _placed_experts(spec, _host_experts(spec, rng), spec.shape[0], mesh, pack)


def _random_expert_stack(spec: TensorSpec, rng: np.random.Generator) -> ExpertStack:
    """random_leaf's values for an MoE matrix, one host QuantizedWeight per expert, for layer stacks: written into
    them an expert at a time (stacking.put_layer_pieces), not placed whole and then copied in."""
    return ExpertStack(tuple(_host_experts(spec, rng)))
