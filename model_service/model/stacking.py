"""The scanned layers' parameters (Backend.scan_layers): each per-layer leaf of the checkpoint
(`transformer/decoder_layer_<i>/...`) becomes one array of every layer along a leading, unsharded layer axis under
one module (sharding.LAYER_STACK), the tree transformer.scan_layers runs its loop over.

The stacks are assembled on the devices: a stacked array is allocated on its devices when the first of its layers
arrives and each layer is written into it in place (the stack donated). A loader hands `put_layer_pieces` a layer's
host (or file) arrays and each is placed and written a piece at a time (an MoE matrix one expert at a time), the host
waiting for each write before it places the next piece, so beside the stacks the devices hold one expert's matrix,
never a layer's tensor twice (checkpoint.load_params(stack_layers=True); Grok-1's widths: 192 MiB, not a 1.5 GiB
matrix, on top of the weights; tests/test_load_peak.py).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model_service.file_arrays import FileArray
from model_service.shard_reads import place_file_array
from model_service.sharding import LAYER_STACK, fit_spec, path_to_str, spec_for_path

Params = dict[str, dict[str, Any]]

_LAYER = re.compile(r"transformer/decoder_layer_([0-9]+)/(.+)")


def stacked_module(module: str) -> tuple[int, str] | None:
    """(layer, the stacked module) of a per-layer module path; None for the language model's."""
    found = _LAYER.fullmatch(module)
    return None if found is None else (int(found[1]), LAYER_STACK + found[2])


def _layer_target(params: Params, module: str, name: str) -> tuple[int, str, str, Any] | None:
    """For a per-layer `module`'s parameter `name`: (its layer, its stacked module, the stack's path, the stack
    allocated so far or None); None for a module that is not a layer's."""
    found = stacked_module(module)
    if found is None:
        return None
    layer, stacked = found
    return layer, stacked, f"{stacked}/{name}", params.setdefault(stacked, {}).get(name)


def put_layer(params: Params, module: str, name: str, leaf: Any, num_layers: int, mesh: Mesh) -> bool:
    """Write `leaf` (a placed parameter of per-layer `module`) into its stack in `params` (allocated on the first
    layer that arrives). False, and nothing done, for a module that is not a layer's."""
    target = _layer_target(params, module, name)
    if target is None:
        return False
    layer, stacked, base, held = target

    def put(path: tuple[Any, ...], one: jax.Array, stack: jax.Array | None) -> jax.Array:
        shape = (num_layers, *one.shape)
        sharding = NamedSharding(mesh, fit_spec(spec_for_path(f"{base}/{path_to_str(path)}".rstrip("/")), shape, mesh))
        if stack is None:
            stack = jnp.zeros(shape, one.dtype, device=sharding)
        return _setter(sharding)(stack, one, jnp.int32(layer))

    if held is None:
        params[stacked][name] = jax.tree_util.tree_map_with_path(lambda p, a: put(p, a, None), leaf)
    else:
        params[stacked][name] = jax.tree_util.tree_map_with_path(put, leaf, held)
    # Written before the caller drops `leaf` and places the next one (write_pieces says why).
    params[stacked][name] = jax.block_until_ready(params[stacked][name])
    return True


def put_layer_pieces(params: Params, module: str, name: str, leaf: Any, num_layers: int, mesh: Mesh) -> bool:
    """Like put_layer, but `leaf` is the parameter's host form (numpy arrays or file_arrays.FileArrays, in a
    QuantizedWeight, GroupedWeight or alone): each array is placed and written into its stack a piece at a time
    (write_pieces), so no layer's whole tensor is ever on the devices beside its stack."""
    target = _layer_target(params, module, name)
    if target is None:
        return False
    layer, stacked, base, held = target

    def put(path: tuple[Any, ...], one: Any, stack: jax.Array | None) -> jax.Array:
        shape = (num_layers, *one.shape)
        if stack is None:
            spec = fit_spec(spec_for_path(f"{base}/{path_to_str(path)}".rstrip("/")), shape, mesh)
            stack = jnp.zeros(shape, one.dtype, device=NamedSharding(mesh, spec))
        return write_pieces(stack, one, (layer,), mesh)

    if held is None:
        params[stacked][name] = jax.tree_util.tree_map_with_path(lambda p, a: put(p, a, None), leaf)
    else:
        params[stacked][name] = jax.tree_util.tree_map_with_path(put, leaf, held)
    return True


def write_pieces(dest: jax.Array, one: Any, at: tuple[int, ...], mesh: Mesh) -> jax.Array:
    """`dest` with the host or file array `one` written at leading index `at`, in place (`dest` donated): an array
    of 3 or more axes (an MoE matrix's [E, K, N]) one index of its first axis at a time, each piece placed on the
    devices (on the sharding `dest`'s has for it) only while it is written; smaller arrays whole.

    The host waits for each write before it places the next piece: placing and writing are asynchronous, and a
    piece Python drops stays on the device until its write has run, so without the wait the host, far ahead of the
    device, placed a whole matrix's pieces before the first was written (on a TPU v5e at Grok-1's widths the last
    MoE matrix's 8 x 192 MiB beside the weights: 13.08 GB at peak against 11.53 GB held)."""
    pieces = [(at, one)] if len(one.shape) < 3 else [((*at, e), one[e]) for e in range(one.shape[0])]
    for where, piece in pieces:  # a FileArray's piece is a view: read when placed
        entries = (*tuple(dest.sharding.spec), *(None,) * dest.ndim)[len(where):dest.ndim]
        sharding = NamedSharding(mesh, PartitionSpec(*entries))
        placed = place_file_array(piece, sharding) if isinstance(piece, FileArray) else \
            jax.device_put(np.asarray(piece), sharding)
        dest = _writer(dest.sharding, len(where))(dest, placed, jnp.asarray(where, jnp.int32))
        del placed  # freed once the write has run: the wait below
        dest = jax.block_until_ready(dest)
    return dest


@functools.lru_cache(maxsize=None)
def _writer(sharding: NamedSharding, lead: int) -> Any:
    """dest [..., *piece] <- piece at leading index `at` (`lead` entries), in place (dest donated)."""
    def write(dest: jax.Array, piece: jax.Array, at: jax.Array) -> jax.Array:
        start = (*(at[i] for i in range(lead)), *(jnp.int32(0),) * (dest.ndim - lead))
        return jax.lax.dynamic_update_slice(dest, piece.astype(dest.dtype).reshape((1,) * lead + piece.shape), start)

    return jax.jit(write, donate_argnums=(0,), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _setter(sharding: NamedSharding) -> Any:
    """stack [L, ...] <- one [...] at layer i, in place (the stack donated), the stack staying on `sharding`."""
    return jax.jit(lambda stack, one, i: jax.lax.dynamic_update_index_in_dim(stack, one.astype(stack.dtype), i, 0),
                   donate_argnums=(0,), out_shardings=sharding)


def stack_params(params: Params, num_layers: int, mesh: Mesh) -> Params:
    """A tree with per-layer modules -> the stacked tree (one already stacked comes back as it is). The per-layer
    arrays stay alive while the caller holds `params`: each stacked parameter is a copy (a loader that stacks as it
    places, load_params(stack_layers=True), never holds both)."""
    out: Params = {}
    for module, leaves in params.items():
        for name, leaf in leaves.items():
            if not put_layer(out, module, name, leaf, num_layers, mesh):
                out.setdefault(module, {})[name] = leaf
    return out
