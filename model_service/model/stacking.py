"""The scanned layers' parameters (Backend.scan_layers): each per-layer leaf of the checkpoint
(`transformer/decoder_layer_<i>/...`) becomes one array of every layer along a leading, unsharded layer axis under
one module (sharding.LAYER_STACK), the tree transformer.scan_layers runs its loop over.

The stacks are assembled on the devices: a stacked array is allocated on its devices when the first of its layers
arrives and each layer is written into it in place (the stack donated), so a loader that places one tensor at a
time holds the stacks and one layer's tensor, never a parameter twice (checkpoint.load_params(stack_layers=True)).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from model_service.sharding import LAYER_STACK, fit_spec, path_to_str, spec_for_path

Params = dict[str, dict[str, Any]]

_LAYER = re.compile(r"transformer/decoder_layer_([0-9]+)/(.+)")


def stacked_module(module: str) -> tuple[int, str] | None:
    """(layer, the stacked module) of a per-layer module path; None for the language model's."""
    found = _LAYER.fullmatch(module)
    return None if found is None else (int(found[1]), LAYER_STACK + found[2])


def put_layer(params: Params, module: str, name: str, leaf: Any, num_layers: int, mesh: Mesh) -> bool:
    """Write `leaf` (a placed parameter of per-layer `module`) into its stack in `params` (allocated on the first
    layer that arrives). False, and nothing done, for a module that is not a layer's."""
    found = stacked_module(module)
    if found is None:
        return False
    layer, stacked = found
    base = f"{stacked}/{name}"
    held = params.setdefault(stacked, {}).get(name)

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
    return True


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
