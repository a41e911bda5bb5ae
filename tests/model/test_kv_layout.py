"""The KV pool's two layouts (kv_memory.LAYOUTS): the accelerators' tokens layout holds the same keys as the CPU's
heads layout, and attention over either gives the same bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.backend import choose_backend
from model_service.config import MeshConfig
from model_service.kv_memory import init_pools, pool_shape, read_blocks, write_tokens
from model_service.model.layers import paged_attention
from model_service.sharding import make_mesh
from tests.procs import GOLDEN


def _as_tokens(pool: np.ndarray) -> np.ndarray:
    """A heads-layout pool [N, Hkv, bs, D] in the tokens layout [N, bs, Hkv * D]."""
    n, h, bs, d = pool.shape
    return pool.transpose(0, 2, 1, 3).reshape(n, bs, h * d)


def test_the_tokens_layout_is_lane_dense_for_any_key_size():
    assert pool_shape(10, 16, 8, 32, "tokens") == (11, 16, 256)  # medium: 8 heads of 32, one 256-wide row a token
    assert pool_shape(10, 16, 8, 32) == (11, 8, 16, 32)
    with pytest.raises(ValueError, match="layout"):
        pool_shape(10, 16, 8, 32, "rows")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_writes_and_reads_agree_between_the_layouts(dtype):
    rng = np.random.default_rng(0)
    heads, = (p.k for p in init_pools(6, 4, 1, 2, 8, dtype))
    tokens, = (p.k for p in init_pools(6, 4, 1, 2, 8, dtype, "tokens"))
    new = jnp.asarray(rng.standard_normal((5, 2, 8)), dtype)
    blocks, offsets = jnp.array([0, 3, 3, 6, 2]), jnp.array([1, 0, 3, 2, 3])
    heads, tokens = write_tokens(heads, new, blocks, offsets), write_tokens(tokens, new, blocks, offsets)
    np.testing.assert_array_equal(_as_tokens(np.asarray(heads, np.float32)), np.asarray(tokens, np.float32))
    ids = jnp.array([[3, 0], [6, 2]])
    np.testing.assert_array_equal(np.asarray(read_blocks(heads, ids, 2), np.float32).transpose(0, 1, 3, 2, 4),
                                  np.asarray(read_blocks(tokens, ids, 2), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_attention_gives_the_same_bits_over_either_layout(dtype):
    rng = np.random.default_rng(1)
    blocks, hkv, bs, d, hq = 9, 2, 4, 8, 4
    pool_k = rng.standard_normal((blocks, hkv, bs, d)).astype(np.float32)
    pool_v = rng.standard_normal((blocks, hkv, bs, d)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((3, 2, hq, d)), dtype)
    tables = jnp.array([[4, 1, 7, 0], [2, 8, 8, 8], [5, 6, 3, 8]])
    limit = jnp.array([[9, 10], [2, 3], [13, 14]])
    run = jax.jit(lambda q, k, v: paged_attention(q, k, v, tables, limit, 0.125, 8))
    heads = run(q, jnp.asarray(pool_k, dtype), jnp.asarray(pool_v, dtype))
    tokens = run(q, jnp.asarray(_as_tokens(pool_k), dtype), jnp.asarray(_as_tokens(pool_v), dtype))
    np.testing.assert_array_equal(np.asarray(heads, np.float32), np.asarray(tokens, np.float32))


def test_the_generic_backend_takes_the_tokens_layout_and_the_cpu_backend_the_heads_layout():
    from model_service.config import load_model_config
    from model_service.model import GrokModel

    cfg = load_model_config(str(GOLDEN / "config.json"))
    mesh = make_mesh(MeshConfig(1, 1))
    t = cfg.model
    # the generic backend's layers scanned: every layer's pool in one array (tests/model/test_scan_layers.py)
    for name, want in (("generic", (t.num_layers, 5, 16, t.num_kv_heads * t.key_size)),
                       ("cpu", (5, t.num_kv_heads, 16, t.key_size))):
        model = GrokModel(cfg, mesh, jnp.float32, backend=choose_backend(name, mesh, jnp.float32))
        assert jax.tree.leaves(model.init_pools(4))[0].shape == want
        assert jax.tree.leaves(model.pools_shardings(4))[0].shard_shape(want) == want
