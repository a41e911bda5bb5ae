"""GrokModel's engine-facing behaviour: token rows of sequences at their own positions, bits independent of
what shares a call or how a prompt is split, padding rows, tiles, pad masking in the dense pass, MoE routing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.checkpoint import random_params
from model_service.config import load_model_config
from model_service.model.layers import ExpertStack, Products, QuantizedWeight, product
from model_service.model.packed import PackedWeight
from model_service.model.moe import (
    ExpertWeights,
    Routing,
    experts_by_cond,
    grouped_experts,
    pick_tile,
)

from tests.model.conftest import RowRunner
from tests.procs import ROOT

rng = np.random.default_rng(0)


def _prompt(n: int, vocab: int = 64) -> np.ndarray:
    return rng.integers(3, vocab, n).astype(np.int32)


def _rows(seq: int, prompt: np.ndarray, start: int = 0) -> list[tuple[int, int, int]]:
    return [(seq, start + i, int(t)) for i, t in enumerate(prompt)]


def test_token_rows_continue_a_prompt_exactly_like_a_full_forward_pass(tiny) -> None:
    seq = _prompt(12)
    full = np.asarray(tiny.forward(tiny.params, jnp.asarray(seq[None])))[0]
    runner = RowRunner(tiny, 2)
    np.testing.assert_allclose(runner.run(_rows(1, seq[:5]))[4], full[4], atol=1e-4)
    for i in range(5, 12):
        np.testing.assert_allclose(runner.run([(0, 0, 7), (1, i, int(seq[i]))])[1], full[i], atol=1e-4)


def test_sequences_at_their_own_positions_are_computed_independently(tiny) -> None:
    a, b = _prompt(4), _prompt(9)
    together, alone = RowRunner(tiny, 3, tile=4), RowRunner(tiny, 3, tile=4)
    both = together.run(_rows(0, a) + _rows(2, b))
    np.testing.assert_array_equal(both[:4], alone.run(_rows(0, a)))
    for tok in (5, 6, 7):
        la = alone.run([(0, 4 + tok - 5, tok)])
        lb = together.run([(2, 9 + tok - 5, 9), (0, 4 + tok - 5, tok)])
        np.testing.assert_array_equal(lb[1], la[0])


def test_a_prompt_split_over_calls_gives_the_bits_of_one_call(tiny) -> None:
    prompt = _prompt(14)
    whole = RowRunner(tiny, 2, tile=4).run(_rows(1, prompt))
    for cut in ((3, 9), (1, 2, 5, 13), (7,)):
        runner = RowRunner(tiny, 2, tile=4)
        pieces, start = [], 0
        for end in cut + (14,):
            pieces.append(runner.run(_rows(1, prompt[start:end], start)))
            start = end
        np.testing.assert_array_equal(np.concatenate(pieces), whole)


def test_pad_tokens_in_a_dense_pass_are_masked_as_keys(tiny) -> None:
    prompt = _prompt(8)
    prompt[3] = tiny.cfg.pad_token
    base = np.asarray(tiny.forward(tiny.params, jnp.asarray(prompt[None])))[:, -1]
    params = jax.tree.map(lambda x: x, tiny.params)
    table, pad = params["language_model/in_out_embed"]["embeddings"], tiny.cfg.pad_token
    if isinstance(table, PackedWeight):  # native products: the table is packed [V/16, D, 16]
        table = dataclasses.replace(table, packed=table.packed.at[pad // 16, :, pad % 16].set(5.0))
    else:
        table = table.at[pad].set(5.0)
    params["language_model/in_out_embed"] = {"embeddings": table}
    changed = np.asarray(tiny.forward(params, jnp.asarray(prompt[None])))[:, -1]
    # the table is tied, so only the pad id's own logit may move
    np.testing.assert_allclose(changed[:, 1:], base[:, 1:], atol=1e-5)
    # the pad position is not simply ignored: putting a real token there changes the output
    prompt[3] = 1
    other = np.asarray(tiny.forward(tiny.params, jnp.asarray(prompt[None])))[:, -1]
    assert not np.allclose(other[:, 1:], base[:, 1:], atol=1e-3)


def _experts(e: int, d: int, f: int) -> ExpertWeights:
    def q(shape: tuple[int, int], blocks: int, n: int) -> ExpertStack:
        return ExpertStack(tuple(QuantizedWeight(jnp.asarray(rng.integers(-127, 128, shape), jnp.int8),
                                                 jnp.asarray(rng.uniform(0.001, 0.01, (blocks, n)), jnp.float32))
                                 for _ in range(e)))
    # column-parallel stored [E, N, K]; row-parallel (8 block scales) stored [E, K, N]
    return ExpertWeights(q((f, d), 1, f), q((f, d), 1, f), q((f, d), 8, d))


def _dense_reference(x: np.ndarray, routing: Routing, w: ExpertWeights) -> np.ndarray:
    def deq(q: ExpertStack, e: int) -> np.ndarray:  # [N, K] float64
        wt, sc = np.asarray(q.experts[e].weight, np.float64), np.asarray(q.experts[e].scales, np.float64)
        if sc.shape[0] == 1:
            return wt * sc[0][:, None]
        k, n = wt.shape
        return (wt.reshape(8, k // 8, n) * sc[:, None, :]).reshape(k, n).T
    gelu = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))  # noqa: E731
    out = np.zeros(x.shape)
    for m in range(x.shape[0]):
        for gate, e in zip(np.asarray(routing.gates[m]), np.asarray(routing.experts[m])):
            h = gelu(deq(w.linear, e) @ x[m]) * (deq(w.linear_v, e) @ x[m])
            out[m] += gate * (deq(w.linear_1, e) @ h)
    return out


@pytest.mark.parametrize("m,tile", [(1, 1), (5, 5), (8, 8), (40, 8), (40, 3)])
def test_grouped_experts_equal_the_dense_per_token_sum(m: int, tile: int) -> None:
    w = _experts(8, 16, 32)
    x = rng.standard_normal((m, 16)).astype(np.float32)
    experts = np.stack([rng.permutation(8)[:2] for _ in range(m)]).astype(np.int32)
    routing = Routing(jnp.asarray(rng.uniform(0.1, 0.5, (m, 2)), jnp.float32), jnp.asarray(experts))
    want = _dense_reference(x, routing, w)
    got = jax.jit(grouped_experts, static_argnums=3)(jnp.asarray(x), routing, w, tile)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(jax.jit(experts_by_cond)(jnp.asarray(x), routing, w)), want,
                               rtol=1e-4, atol=1e-4)


def test_unselected_experts_are_never_computed() -> None:
    w = _experts(8, 16, 32)
    nan = [q._replace(scales=q.scales * jnp.nan) if e >= 5 else q for e, q in enumerate(w.linear.experts)]
    poisoned = w._replace(linear=ExpertStack(tuple(nan)))
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    routing = Routing(jnp.full((6, 2), 0.5, jnp.float32), jnp.asarray(rng.integers(0, 5, (6, 2)), jnp.int32))
    for tile in (pick_tile(6, 2, 8), 2):
        assert np.isfinite(np.asarray(grouped_experts(x, routing, poisoned, tile))).all()
    assert np.isfinite(np.asarray(experts_by_cond(x, routing, poisoned))).all()
    routing = routing._replace(experts=routing.experts.at[0, 0].set(6))
    assert not np.isfinite(np.asarray(grouped_experts(x, routing, poisoned, 2))).all()
    assert not np.isfinite(np.asarray(experts_by_cond(x, routing, poisoned))).all()


def test_free_slots_never_make_an_expert_run() -> None:
    w = _experts(8, 16, 32)
    nan = [q._replace(scales=q.scales * jnp.nan) if e >= 5 else q for e, q in enumerate(w.linear.experts)]
    poisoned = w._replace(linear=ExpertStack(tuple(nan)))
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, 5, (6, 2)), jnp.int32).at[0, 0].set(6)  # only row 0 wants expert 6
    routing = Routing(jnp.full((6, 2), 0.5, jnp.float32), experts)
    free_row_0 = jnp.arange(6) > 0
    assert np.isfinite(np.asarray(experts_by_cond(x, routing, poisoned, free_row_0))).all()
    assert not np.isfinite(np.asarray(experts_by_cond(x, routing, poisoned, jnp.ones((6,), bool)))).all()


def test_padding_rows_leave_the_other_rows_bit_identical_and_write_nothing(tiny) -> None:
    rows = [(s, 0, int(t)) for s, t in enumerate((5, 9, 11, 13))]
    every = RowRunner(tiny, 4, tile=4)
    some = RowRunner(tiny, 4, tile=4)
    all_logits = every.run(rows)
    some_logits = some.run(rows, valid=[True, False, True, False])
    np.testing.assert_array_equal(some_logits[[0, 2]], all_logits[[0, 2]])
    per = tiny.model.blocks_per_sequence
    for layer in range(len(some.pools)):
        pool, fresh = np.asarray(some.pools[layer].k), np.asarray(tiny.model.init_pools(4 * per)[layer].k)
        for s in (1, 3):  # a padding row writes into the scratch block only
            np.testing.assert_array_equal(pool[s * per:(s + 1) * per], fresh[s * per:(s + 1) * per])
        np.testing.assert_array_equal(pool[:per], np.asarray(every.pools[layer].k)[:per])


def _numpy_dequantised(weight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The checkpoint's [K, N] matrix in float64: each int8 entry times its block's scale, computed
    independently of model_service (row block b covers rows b*K/blocks .. (b+1)*K/blocks - 1)."""
    k, _ = weight.shape
    block_of_row = np.arange(k) // (k // scales.shape[0])
    return weight.astype(np.float64) * scales.astype(np.float64)[block_of_row, :]


# Every form that multiplies the rows as given (DOT_INT8 rounds them first: tests/model/test_int8_rows.py).
@pytest.mark.parametrize("products", [p for p in Products if p is not Products.DOT_INT8])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("blocks", [1, 8])
def test_int8_products_match_an_independent_numpy_product(rows: int, blocks: int, products: Products) -> None:
    weight = rng.integers(-127, 128, (64, 24)).astype(np.int8)  # the checkpoint's [K, N]
    scales = rng.uniform(0.5, 1.5, (blocks, 24)).astype(np.float32)
    # one scale block (column-parallel) is stored [N, K] as loaded; row blocks keep the checkpoint's [K, N]
    q = QuantizedWeight(jnp.asarray(weight.T if blocks == 1 else weight), jnp.asarray(scales))
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    want = x.astype(np.float64) @ _numpy_dequantised(weight, scales)
    got = jax.jit(product, static_argnums=2)(jnp.asarray(x), q, products)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-3)  # sums of ~1e4-sized terms


@pytest.mark.parametrize("products", list(Products))
def test_a_row_is_bit_identical_whatever_number_of_tiles_runs(golden_model, products: Products) -> None:
    from model_service.model import GrokModel

    loaded = golden_model("1,1", "float32")
    model = GrokModel(loaded.cfg, loaded.model.mesh, jnp.float32, products)
    params = model.pack_params(loaded.params) if products.native else loaded.params
    view = dataclasses.replace(loaded, model=model, params=params)
    prompts = [_prompt(n, loaded.cfg.vocab_size) for n in (5, 11, 3, 14, 7, 9, 2, 12)]
    rows = [r for i, p in enumerate(prompts) for r in _rows(i, p)]  # 63 rows: 16 tiles of 4
    results = {}
    for tiles in (4, 9, 16):  # one program: the number of tiles that run is traced
        runner = RowRunner(view, 8, tile=4)
        results[tiles] = runner.run(rows, size=64, tiles=tiles)
    for tiles, logits in results.items():
        np.testing.assert_array_equal(logits[:4 * tiles], results[16][:4 * tiles], err_msg=str(tiles))
        assert not logits[4 * tiles:].any()  # rows past the tiles that ran come out zero


@pytest.mark.parametrize("shapes", ["golden", "demo"])
def test_a_row_is_bit_identical_in_every_tile_size_a_step_program_runs(golden_model, shapes: str) -> None:
    """The engine runs a step of few rows in one program of 8, 16 or 32 rows (engine.SMALL_TILES) and the others
    in the 64-row program: with native products on one device a row's last hidden state (what the engine's head
    and scores then take in shapes of their own: tests/model/test_head.py) is the same bits in each, for prompt
    rows (a first step of 63, and chunks continuing prompts) and decode rows, over the same keys. On the golden
    model and at the demo model's widths (random parameters): XLA:CPU's forms change at 4,096 elements."""
    from model_service.engine import SMALL_TILES
    from model_service.model import GrokModel

    loaded = golden_model("1,1", "float32")
    cfg = loaded.cfg if shapes == "golden" else load_model_config(str(ROOT / "demo" / "config.json"))
    model = GrokModel(cfg, loaded.model.mesh, jnp.float32, Products.NATIVE)
    if not model.row_sums:
        pytest.skip("the native kernels are not built")
    params = model.pack_params(loaded.params) if shapes == "golden" else random_params(
        cfg, loaded.model.mesh, jnp.float32, seed=64, pack=True, stacked=model.backend.stacked_experts)
    view = dataclasses.replace(loaded, cfg=cfg, model=model, params=params)
    prompts = [_prompt(n, cfg.vocab_size) for n in (5, 11, 3, 14, 7, 9, 2, 12)]
    first = RowRunner(view, 8, tile=64)
    first.run([r for i, p in enumerate(prompts) for r in _rows(i, p)], size=64, hidden=True)  # 63 prompt rows
    keys = first.pools
    # The next step: decode rows of sequences 0-3, then chunks of 6 rows continuing sequences 4-7 (28 rows); a
    # program of t rows takes the first t of them.
    decode = [(i, len(p), int(p[0])) for i, p in enumerate(prompts[:4])]
    chunks = [r for i, p in enumerate(prompts[4:], 4) for r in _rows(i, _prompt(6, cfg.vocab_size), len(p))]
    step = decode + chunks
    for tile in SMALL_TILES:
        small, whole = RowRunner(view, 8, tile=tile), RowRunner(view, 8, tile=64)
        small.pools = whole.pools = keys
        np.testing.assert_array_equal(small.run(step[:tile], size=tile, hidden=True),
                                      whole.run(step[:tile], size=64, hidden=True), err_msg=f"a program of {tile}")
