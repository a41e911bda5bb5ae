"""The native kernel inside JAX programs: jit, the per-shard split over 8-device meshes (shard_map), the choice
of products (--products) and the pure-XLA fallback when the kernel is disabled."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service import kernels
from model_service.config import MeshConfig
from model_service.backend import choose_products
from model_service.model import Products
from model_service.model.layers import ExpertStack, QuantizedWeight, product
from model_service.model.packed import COLUMNS, ROWS, pack_quantized
from model_service.sharding import make_mesh, params_shardings

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _weight(rng: np.random.Generator, k: int, n: int, blocks: int) -> QuantizedWeight:
    w = rng.integers(-127, 128, (k, n), dtype=np.int8)
    s = rng.uniform(0.5, 2.0, (blocks, n)).astype(np.float32) / 127
    return QuantizedWeight(w.T.copy() if blocks == 1 else w, s)


def _placed(q: QuantizedWeight, mesh: jax.sharding.Mesh, module: str) -> object:
    """Pack for `mesh` and place with the partition rules, as checkpoint.load_params(pack=True) does."""
    tree = {module: {"w": ExpertStack((pack_quantized(q, mesh),))}}
    return jax.device_put(tree, params_shardings(tree, mesh))[module]["w"].experts[0]


@pytest.mark.parametrize("mesh_shape", ["1,8", "2,4"])
@pytest.mark.parametrize("rows", [3, 4])
def test_sharded_column_parallel_products_are_bit_identical_to_one_device(mesh_shape: str, rows: int) -> None:
    rng = np.random.default_rng(1)
    q = _weight(rng, 128, 688, 1)  # golden's expert: 688 columns = 86 per shard of 8, not whole 16-column blocks
    x = jnp.asarray(rng.standard_normal((rows, 128)).astype(np.float32))
    one = np.asarray(jax.jit(product, static_argnums=2)(x, jax.tree.map(jnp.asarray, pack_quantized(q, None)),
                                                        Products.NATIVE))
    mesh = make_mesh(MeshConfig.parse(mesh_shape))
    w = _placed(q, mesh, "transformer/decoder_layer_0/moe/linear")
    assert w.split == COLUMNS and w.shards == mesh.shape["model"]
    got = np.asarray(jax.jit(product, static_argnums=2)(x, w, Products.NATIVE))
    np.testing.assert_array_equal(got, one)
    used = jnp.arange(rows) % 2 == 0
    masked = np.asarray(jax.jit(product, static_argnums=2)(x, w, Products.NATIVE, used))
    np.testing.assert_array_equal(masked[np.asarray(used)], one[np.asarray(used)])
    assert np.all(masked[~np.asarray(used)] == 0)


@pytest.mark.parametrize("mesh_shape", ["1,8", "2,4"])
def test_sharded_row_parallel_products_sum_whole_scale_blocks_per_shard(mesh_shape: str) -> None:
    rng = np.random.default_rng(2)
    q = _weight(rng, 688, 128, 8)  # golden's linear_1: 8 blocks of 86 rows
    x = rng.standard_normal((4, 688)).astype(np.float32)
    mesh = make_mesh(MeshConfig.parse(mesh_shape))
    w = _placed(q, mesh, "transformer/decoder_layer_0/moe/linear_1")
    assert w.split == ROWS and w.packed.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    got = np.asarray(jax.jit(product, static_argnums=2)(jnp.asarray(x), w, Products.NATIVE))
    scale = np.repeat(q.scales.astype(np.float64), 86, axis=0)
    ref = x.astype(np.float64) @ (q.weight.astype(np.float64) * scale)
    bound = 700 * 2.0**-24 * (np.abs(x) @ np.abs(q.weight.astype(np.float64) * scale))
    assert np.all(np.abs(got - ref) <= bound)
    # Row invariance survives the split: each row alone gives the same bits.
    alone = np.concatenate([np.asarray(jax.jit(product, static_argnums=2)(jnp.asarray(x[i:i + 1]), w, Products.NATIVE))
                            for i in range(4)])
    np.testing.assert_array_equal(got, alone)
    # So does the row mask: unmarked rows are zero, marked ones keep their bits.
    used = jnp.asarray([True, False, False, True])
    masked = np.asarray(jax.jit(product, static_argnums=2)(jnp.asarray(x), w, Products.NATIVE, used))
    np.testing.assert_array_equal(masked[[0, 3]], got[[0, 3]])
    assert np.all(masked[[1, 2]] == 0)


def test_auto_picks_native_on_cpu_in_float32_and_xla_otherwise() -> None:
    mesh = make_mesh(MeshConfig())
    assert choose_products("auto", mesh, jnp.float32) is Products.NATIVE
    assert choose_products("native", mesh, jnp.float32) is Products.NATIVE
    assert choose_products("native-int8", mesh, jnp.float32) is Products.NATIVE_INT8
    assert Products.NATIVE_INT8.native and Products.NATIVE.native and not Products.FUSED_REDUCE.native
    assert choose_products("xla", mesh, jnp.float32) is Products.FUSED_REDUCE
    assert choose_products("auto", mesh, jnp.bfloat16) is Products.FUSED_REDUCE
    with pytest.raises(ValueError, match="--products native needs"):
        choose_products("native", mesh, jnp.bfloat16)
    with pytest.raises(ValueError, match="--products native-int8 needs"):
        choose_products("native-int8", mesh, jnp.bfloat16)
    with pytest.raises(ValueError, match="one of"):
        choose_products("fast", mesh, jnp.float32)


def test_int8_rows_on_a_cpu_without_the_int8_instructions_warn_that_they_are_no_faster(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Without AVX-512 VNNI (and VBMI/BW) the int8 rows run on VPMADDWD, no faster than float32 FMAs: at Grok-1
    width on an AVX2 box native-int8 decoded 8 streams at half native's rate. Still allowed (it is what was
    asked), but the log says so and names the flag to use."""
    mesh = make_mesh(MeshConfig())
    monkeypatch.setattr(kernels, "int8_accelerated", lambda: False)
    with caplog.at_level("WARNING"):
        assert choose_products("native-int8", mesh, jnp.float32) is Products.NATIVE_INT8
    assert any("--products native-int8" in r.getMessage() and "--products native" in r.getMessage()
               and "VNNI" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    monkeypatch.setattr(kernels, "int8_accelerated", lambda: True)
    with caplog.at_level("WARNING"):
        choose_products("native-int8", mesh, jnp.float32)
    assert not caplog.records


def test_the_extension_says_whether_int8_rows_are_accelerated_as_the_cpu_reports() -> None:
    """The kernel's own check (AVX-512 F/BW/VBMI/VNNI), read back; compared here with Linux's flags."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = next(line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("flags"))
    wanted = {"avx512f", "avx512bw", "avx512vbmi", "avx512_vnni"}
    assert kernels.int8_accelerated() == wanted.issubset(flags)


def test_an_isa_forced_by_the_environment_is_used_when_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ISA_ENV, "scalar")
    assert kernels.default_isa() == "scalar"
    monkeypatch.setenv(kernels.ISA_ENV, "neon")
    assert kernels.default_isa() == "auto"


FALLBACK = """
import logging, jax.numpy as jnp, numpy as np
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from model_service import kernels
from model_service.config import MeshConfig, load_model_config
from model_service.checkpoint import load_params
from model_service.backend import choose_products
from model_service.model import GrokModel, Products
from model_service.sharding import make_mesh
mesh = make_mesh(MeshConfig())
assert not kernels.available()
assert choose_products("auto", mesh, jnp.float32) is Products.FUSED_REDUCE
try:
    choose_products("native", mesh, jnp.float32)
    raise SystemExit("native accepted without the kernels")
except ValueError:
    pass
cfg = load_model_config("{golden}/config.json")
model = GrokModel(cfg, mesh, jnp.float32)
params = load_params("{golden}/checkpoint", cfg, mesh, jnp.float32)
tokens = jnp.asarray(np.arange(3, 11, dtype=np.int32)[None])
print("logits", np.asarray(model.forward(params, tokens)).shape)
"""


def test_with_the_kernels_disabled_everything_runs_on_xla_with_one_log_line() -> None:
    from tests.procs import GOLDEN

    env = {**os.environ, kernels.ISA_ENV: "off", "XLA_FLAGS": "", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", FALLBACK.format(golden=GOLDEN)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "logits (1, 8, 512)" in done.stdout
    assert done.stderr.count("native kernels disabled") == 1, done.stderr


def test_vmap_over_a_batch_of_row_sets_equals_each_call() -> None:
    rng = np.random.default_rng(5)
    q = _weight(rng, 64, 40, 1)
    w = jax.tree.map(jnp.asarray, pack_quantized(q, None))
    xs = jnp.asarray(rng.standard_normal((3, 2, 64)).astype(np.float32))
    batched = np.asarray(jax.jit(jax.vmap(lambda x: product(x, w, Products.NATIVE)))(xs))
    for i in range(3):
        np.testing.assert_array_equal(batched[i], np.asarray(product(xs[i], w, Products.NATIVE)))


def test_the_products_flag_reads_its_environment_variable_and_rejects_unknown_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from model_service.__main__ import parser

    assert parser().parse_args(["--config", "c"]).products == "auto"
    monkeypatch.setenv("GROK_MODEL_PRODUCTS", "xla")
    assert parser().parse_args(["--config", "c"]).products == "xla"
    assert parser().parse_args(["--config", "c", "--products", "native"]).products == "native"
    assert parser().parse_args(["--config", "c", "--products", "native-int8"]).products == "native-int8"
    with pytest.raises(SystemExit):
        parser().parse_args(["--config", "c", "--products", "fast"])
