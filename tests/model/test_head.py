"""GrokModel.head's batch invariance: a row's logits are the same bits whatever number of rows the head runs over.

The engine's draws program runs the head over one entry per draw: a plain engine of 4 slots over 4 rows, a
speculative one (4 drafts) over 20. XLA:CPU (jax 0.10) hands a reduction of 4,096 elements or more to YNNPACK,
whose summation order is not its own loop's, so the final norm's mean took one order over [4, 512] and another
over [20, 512] (the demo model's width; at the old demo's 128 features both stayed under the threshold): issue
64's speculative engine gave the plain engine's tokens with alternatives off in their last bits. The head now
sums the norm in layers.row_sum's fixed order on one device; these tests run it at the demo model's widths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service import kernels
from model_service.config import MeshConfig, load_model_config
from model_service.model import GrokModel, Products
from model_service.sharding import make_mesh
from tests.procs import ROOT

# The CPU's products (XLA's fused form and the native kernels'); DOT and EXACT are the accelerators' (a dot of
# one row takes another kernel than a dot of several there).
CPU_PRODUCTS = [Products.FUSED_REDUCE, Products.NATIVE, Products.NATIVE_INT8]
ROW_COUNTS = (4, 8, 20, 64)  # plain and speculative draws programs (4 slots, 4 drafts), and more


def _demo_head(products: Products) -> tuple[GrokModel, dict[str, dict[str, jax.Array]]]:
    """A model of the demo's shapes (512 features, 2,048 tokens) with random head parameters."""
    if products.native and not kernels.available():
        pytest.skip("the native kernels are not built")
    cfg = load_model_config(str(ROOT / "demo" / "config.json"))
    model = GrokModel(cfg, make_mesh(MeshConfig()), jnp.float32, products)
    rng = np.random.default_rng(64)
    d, v = cfg.model.emb_size, cfg.vocab_size
    params = {"language_model/in_out_embed": {"embeddings": jnp.asarray(rng.normal(0, 0.05, (v, d)), jnp.float32)},
              "language_model/rms_norm": {"scale": jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)}}
    return model, model.pack_params(params)


@pytest.mark.parametrize("products", CPU_PRODUCTS, ids=lambda p: p.value)
def test_a_rows_logits_are_the_same_bits_alone_and_among_any_number_of_rows(products: Products) -> None:
    model, params = _demo_head(products)
    h = np.random.default_rng(1).normal(0, 3, (max(ROW_COUNTS), model.cfg.model.emb_size)).astype(np.float32)
    head = jax.jit(model.head)
    alone = np.concatenate([np.asarray(head(params, jnp.asarray(h[i:i + 1]), jnp.ones(1, bool)))
                            for i in range(max(ROW_COUNTS))])
    for rows in ROW_COUNTS:
        logits = np.asarray(head(params, jnp.asarray(h[:rows]), jnp.ones(rows, bool)))
        np.testing.assert_array_equal(logits, alone[:rows], err_msg=f"a head of {rows} rows")
