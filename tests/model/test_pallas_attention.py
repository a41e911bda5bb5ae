"""The Pallas decode-attention kernel (kernels/tpu/paged_attention.py, in interpret mode on CPU: the kernel's own
arithmetic and block copies) against XLA's paged attention (layers.paged_attention), and the choices around it."""

from __future__ import annotations

import contextlib
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from model_service.backend import choose_attention, choose_backend
from model_service.config import MeshConfig
from model_service.kernels.tpu.paged_attention import decode_attention, min_block_size
from model_service.kv_memory import LayerPool
from model_service.model import GrokModel
from model_service.model.layers import paged_attention
from model_service.model.segments import attend_segments
from model_service.ops.pallas import PallasAttention
from model_service.sharding import make_mesh
from tests.model.test_grouped_model import TINY
from tests.model.test_segments import STEPS, rows_of

MULTIPLIER, CAP = 0.125, 30.0


def on_tpu_highest() -> contextlib.AbstractContextManager:
    """XLA's float32 reference as the forms run it on a TPU (whose default precision rounds float32 operands to
    bfloat16; ops/xla.py MatrixForms.precision); on CPU its default, float32 exact to these tests' bounds."""
    return jax.default_matmul_precision("highest") if jax.default_backend() == "tpu" else contextlib.nullcontext()


def pools(rng: np.random.Generator, blocks: int, bs: int, width: int, dtype) -> tuple[jax.Array, jax.Array]:
    return tuple(jnp.asarray(rng.standard_normal((blocks + 1, bs, width)) * 3, dtype) for _ in range(2))


def xla(q, pool_k, pool_v, tables, lengths, chunk):
    """Each row over its own keys 0..length-1 (layers.paged_attention); rows of length 0 zeros."""
    out = paged_attention(q[:, None], pool_k, pool_v, tables, jnp.maximum(lengths - 1, 0)[:, None], MULTIPLIER,
                          chunk)[:, 0]
    return jnp.where((lengths > 0)[:, None], out, 0).reshape(q.shape)


@pytest.mark.parametrize("dtype,heads", [(jnp.float32, (2, 6, 32)), (jnp.bfloat16, (2, 6, 32)),
                                         (jnp.float32, (1, 4, 8)), (jnp.bfloat16, (4, 4, 16))],
                         ids=["gqa-float32", "gqa-bfloat16", "one-kv-head-float32", "mha-bfloat16"])
def test_each_row_attends_its_own_blocks_up_to_its_length(dtype, heads) -> None:
    hkv, hq, d = heads
    bs, chunk, n = 16, 32, 6
    rows = 7
    rng = np.random.default_rng(hq * d)
    pool_k, pool_v = pools(rng, rows * n, bs, hkv * d, dtype)
    tables = jnp.asarray(rng.permutation(rows * n).reshape(rows, n), jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, hq, d)), dtype)
    # One key; a block's end; a chunk's end and one past it; a full table; none (an idle lane); a middle.
    lengths = jnp.asarray([1, bs, chunk, chunk + 1, n * bs, 0, 45], jnp.int32)
    got = decode_attention(q, pool_k, pool_v, tables, lengths, MULTIPLIER, CAP, chunk, interpret=True)
    with on_tpu_highest():
        want = xla(q, pool_k, pool_v, tables, lengths, chunk)
    assert got.shape == q.shape and got.dtype == q.dtype
    # float32: the two sum in different orders (an output near 0.01 was 3e-6 apart on one CPU); bfloat16: XLA's
    # form rounds its weights to bf16 first.
    rtol, atol = (2e-6, 1e-5) if dtype == jnp.float32 else (2e-2, 2e-2)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=atol)
    assert not np.asarray(got)[5].any()


def test_a_stacked_pool_is_read_at_its_layer_and_blocks_past_the_length_do_not_count() -> None:
    rng = np.random.default_rng(3)
    bs, chunk, n, rows = 8, 32, 8, 3
    pool_k, pool_v = pools(rng, rows * n, bs, 64, jnp.float32)
    tables = jnp.asarray(rng.permutation(rows * n).reshape(rows, n), jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, 8, 16)), jnp.float32)
    lengths = jnp.asarray([5, 20, 40], jnp.int32)
    one = decode_attention(q, pool_k, pool_v, tables, lengths, MULTIPLIER, CAP, chunk, interpret=True)
    stacked_k, stacked_v = jnp.stack([pool_k * 0 + 7, pool_k, -pool_k]), jnp.stack([pool_v * 0, pool_v, pool_v])
    layer = decode_attention(q, stacked_k, stacked_v, tables, lengths, MULTIPLIER, CAP, chunk, layer=jnp.int32(1),
                             interpret=True)
    np.testing.assert_array_equal(np.asarray(layer), np.asarray(one))
    # Positions past a row's length hold anything (here NaN-free garbage): the result is the same.
    noisy_k = pool_k.at[tables[0, 1:]].set(1e4)
    again = decode_attention(q, noisy_k, pool_v, tables, lengths, MULTIPLIER, CAP, chunk, interpret=True)
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(one[0]))


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="the TPU interpreter runs on CPU; the chip runs the "
                    "compiled kernel (test_the_compiled_kernel_on_tpu_matches_xla)")
def test_the_block_copies_never_race_the_reads_across_chunks_and_rows() -> None:
    """Pallas' TPU interpreter, which runs the DMAs and semaphores as the chip would and detects races: a row's
    next chunk, and the next row's first, are copied into the slot no read is using (idle rows in any place)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    rng = np.random.default_rng(9)
    bs, chunk, n, rows = 8, 16, 4, 6
    pool_k, pool_v = pools(rng, rows * n, bs, 32, jnp.float32)
    tables = jnp.asarray(rng.permutation(rows * n).reshape(rows, n), jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, 4, 16)), jnp.float32)
    simulated = pltpu.InterpretParams(detect_races=True)
    for lengths in ([0, 0, 5, 32, 0, 17], [3, 16, 17, 32, 0, 0]):
        lengths = jnp.asarray(lengths, jnp.int32)
        got = decode_attention(q, pool_k, pool_v, tables, lengths, MULTIPLIER, CAP, chunk, interpret=simulated)
        assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found
        np.testing.assert_allclose(np.asarray(got), np.asarray(xla(q, pool_k, pool_v, tables, lengths, chunk)),
                                   rtol=2e-6, atol=2e-6)


def dots(jaxpr) -> list:
    """Every dot_general in a jaxpr and the jaxprs inside it (the kernel's body sits in pallas_call's params)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += dots(inner)
    return found


def test_the_kernels_bfloat16_dots_ask_for_one_pass_under_the_forms_highest_default() -> None:
    """The forms run the step under default_matmul_precision("highest") (ops/xla.py); a bfloat16 dot that left its
    precision unnamed took that default, and Mosaic refuses to compile a float32 contraction of bfloat16 operands
    ("Bad lhs type": the chip could not build the step with --attention pallas in bfloat16)."""
    rng = np.random.default_rng(2)
    pool_k, pool_v = pools(rng, 8, 16, 32, jnp.bfloat16)
    tables, lengths = jnp.arange(8, dtype=jnp.int32).reshape(2, 4), jnp.asarray([5, 40], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        jaxpr = jax.make_jaxpr(lambda *a: decode_attention(*a, MULTIPLIER, CAP, 32, interpret=True))(
            q, pool_k, pool_v, tables, lengths)
    found = dots(jaxpr.jaxpr)
    bf16 = [e for e in found if e.invars[0].aval.dtype == jnp.bfloat16]
    assert len(bf16) == 2  # the scores and the values
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert [e.params["precision"] for e in bf16] == [(jax.lax.Precision.DEFAULT,) * 2] * 2
    assert all(e.params["precision"] == highest for e in found if e.invars[0].aval.dtype == jnp.float32)


def test_bfloat16_scores_are_rounded_as_the_reference_rounds_them() -> None:
    """The reference's einsum returns bfloat16 scores, which are then capped in float32: the kernel rounds its
    float32-accumulated scores the same way. At Grok-1's head width (128) unrounded scores moved 258 outputs of
    this case beyond the bfloat16 tolerance (by up to 0.11), as on the chip."""
    hkv, hq, d = 8, 48, 128
    bs, chunk, n, rows = 16, 128, 8, 4
    rng = np.random.default_rng(d)
    pool_k, pool_v = pools(rng, rows * n, bs, hkv * d, jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(rows * n).reshape(rows, n), jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, hq, d)), jnp.bfloat16)
    lengths = jnp.asarray([1, 77, 128, n * bs], jnp.int32)
    got = decode_attention(q, pool_k, pool_v, tables, lengths, MULTIPLIER, CAP, chunk, interpret=True)
    want = xla(q, pool_k, pool_v, tables, lengths, chunk)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_the_kernel_refuses_blocks_it_cannot_tile_and_chunks_off_the_table() -> None:
    q = jnp.zeros((2, 4, 8), jnp.bfloat16)
    pool = jnp.zeros((9, 8, 16), jnp.bfloat16)
    tables, lengths = jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32)
    assert (min_block_size(jnp.bfloat16), min_block_size(jnp.float32)) == (16, 8)
    with pytest.raises(ValueError, match="multiples of 16 for bfloat16"):
        decode_attention(q, pool, pool, tables, lengths, MULTIPLIER, CAP, 16, interpret=True)
    with pytest.raises(ValueError, match="chunk 24"):
        decode_attention(q.astype(jnp.float32), pool.astype(jnp.float32), pool.astype(jnp.float32), tables, lengths,
                         MULTIPLIER, CAP, 24, interpret=True)


@pytest.mark.parametrize("chunks", [STEPS[0], STEPS[2]], ids=["decodes", "mixed"])
def test_a_step_with_its_decodes_through_the_kernel_gives_each_row_its_own_attention(chunks) -> None:
    rng = np.random.default_rng(len(chunks))
    slots, table_len, total, bs, chunk = 4, 32, 96, 8, 16
    pool_k, pool_v = pools(rng, slots * table_len, bs, 2 * 8, jnp.float32)
    tables = jnp.asarray(rng.permutation(slots * table_len).reshape(slots, table_len), jnp.int32)
    q = jnp.asarray(rng.standard_normal((total, 4, 8)), jnp.float32)
    seq, pos, active = (jnp.asarray(a) for a in rows_of(chunks, total))
    form = PallasAttention(interpret=True)
    with on_tpu_highest():  # both: a mixed step's prompt rows go through XLA's form inside PallasAttention too
        got = jax.jit(lambda *a: form.attend(*a, MULTIPLIER, chunk))(q, pool_k, pool_v, tables, seq, pos, active)
        want = jax.jit(lambda *a: attend_segments(*a, MULTIPLIER, chunk))(q, pool_k, pool_v, tables, seq, pos, active)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
    assert not np.asarray(got)[~np.asarray(active)].any()
    # And a scanned layer's pools (LayerPool) read in place.
    stacked = [LayerPool(jnp.stack([p * 2, p]), jnp.int32(1)) for p in (pool_k, pool_v)]
    with on_tpu_highest():
        layered = jax.jit(lambda *a: form.attend(a[0], *stacked, *a[1:], MULTIPLIER, chunk))(q, tables, seq, pos,
                                                                                            active)
    np.testing.assert_allclose(np.asarray(layered), np.asarray(want), rtol=2e-6, atol=2e-6)


def test_pallas_attention_is_chosen_only_where_its_kernel_compiles() -> None:
    mesh = make_mesh(MeshConfig())
    assert choose_attention("batched", mesh) == "batched"
    if jax.default_backend() != "tpu":
        assert choose_attention("auto", mesh, jnp.bfloat16) == "batched"
    if jax.default_backend() == "tpu":
        assert choose_attention("pallas", mesh) == "pallas"
    else:
        with pytest.raises(ValueError, match="runs on a TPU"):
            choose_attention("pallas", mesh)
    with pytest.raises(ValueError, match="the generic backend's choice"):
        choose_backend("cpu", mesh, jnp.float32, attention="pallas")
    with pytest.raises(ValueError, match="--attention must be one of"):
        choose_backend("generic", mesh, jnp.float32, attention="flash")
    generic = choose_backend("generic", mesh, jnp.bfloat16)
    assert generic.attention == ("pallas" if jax.default_backend() == "tpu" else "batched")
    kernel = dataclasses.replace(generic, attention="pallas_interpret")
    with pytest.raises(ValueError, match="--block-size 16 or more"):
        GrokModel(TINY, mesh, jnp.bfloat16, block_size=8, key_chunk=16, backend=kernel)
    assert GrokModel(TINY, mesh, jnp.float32, block_size=8, key_chunk=16, backend=kernel).kv_layout == "tokens"


def test_auto_takes_the_kernel_on_one_tpu_device_in_bfloat16_where_its_blocks_tile(monkeypatch) -> None:
    """Measured on a v5e (medium, 2,048-token context: 0.43-0.56x of batched's step), the kernel is auto's choice
    there; float32 (the faithful mode: XLA's accurate tanh and exp), a block size the kernel cannot tile, keys
    narrower than a lane row, a mesh and other platforms keep batched."""
    from model_service import backend

    one = make_mesh(MeshConfig())
    # A one-chip host has no second device: auto reads only the mesh's size there.
    many = (make_mesh(MeshConfig(1, 2)) if jax.device_count() >= 2
            else types.SimpleNamespace(size=2, devices=one.devices))
    monkeypatch.setattr(backend, "platform", lambda mesh: "tpu")
    assert choose_attention("auto", one, jnp.bfloat16, 16) == choose_attention("auto", one, jnp.bfloat16) == "pallas"
    assert choose_attention("auto", one, jnp.bfloat16, 64) == "pallas"
    assert choose_attention("auto", one, jnp.bfloat16, 8) == "batched"
    assert choose_attention("auto", one, jnp.float32, 16) == "batched"
    assert choose_attention("auto", many, jnp.bfloat16, 16) == "batched"
    # The heads compiled on the chip in bfloat16: Grok-1's (48 query heads, keys 8 x 128 wide) and medium's
    # (16, 8 x 32); not the demo's 8 query heads, nor the golden models' keys 8 x 8 wide.
    shapes = [(48, 1024), (16, 256), (32, 128), (8, 128), (16, 64)]
    assert [choose_attention("auto", one, jnp.bfloat16, 16, h) for h in shapes] == ["pallas"] * 3 + ["batched"] * 2
    assert choose_backend("auto", one, jnp.bfloat16, block_size=16, heads=(16, 64)).attention == "batched"
    assert choose_backend("auto", one, jnp.bfloat16, block_size=16).attention == "pallas"
    assert choose_backend("auto", one, jnp.bfloat16, block_size=8).attention == "batched"
    assert choose_backend("auto", one, jnp.bfloat16, attention="batched", block_size=16).attention == "batched"
    monkeypatch.setattr(backend, "platform", lambda mesh: "gpu")
    assert choose_attention("auto", one, jnp.bfloat16, 16) == "batched"


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="the compiled kernel needs a TPU (CPU runs it interpreted)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads", [(8, 48, 128), (8, 16, 32)], ids=["grok-1", "medium"])
def test_the_compiled_kernel_on_tpu_matches_xla(dtype, heads) -> None:
    hkv, hq, d = heads
    bs, chunk, n, rows = 16, 128, 32, 9
    rng = np.random.default_rng(d)
    pool_k, pool_v = pools(rng, rows * n, bs, hkv * d, dtype)
    tables = jnp.asarray(rng.permutation(rows * n).reshape(rows, n), jnp.int32)
    q = jnp.asarray(rng.standard_normal((rows, hq, d)), dtype)
    lengths = jnp.asarray([1, 16, 127, 128, 129, 300, n * bs, 0, 77], jnp.int32)
    with jax.default_matmul_precision("highest"):  # the engine's setting (ops/xla.py MatrixForms.precision)
        got = decode_attention(q, pool_k, pool_v, tables, lengths, MULTIPLIER, CAP, chunk)
        want = xla(q, pool_k, pool_v, tables, lengths, chunk)
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    stacked = [jnp.stack([p, p * 0]) for p in (pool_k, pool_v)]
    with jax.default_matmul_precision("highest"):
        layered = decode_attention(q, *stacked, tables, lengths, MULTIPLIER, CAP, chunk, layer=jnp.int32(0))
    np.testing.assert_array_equal(np.asarray(layered), np.asarray(got))
