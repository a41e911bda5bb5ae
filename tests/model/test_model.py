"""GrokModel's engine-facing behaviour: per-slot decode positions, insert, clamping, pad masking, MoE routing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_service.kv_memory import gather
from model_service.model.layers import ExpertStack, Products, QuantizedWeight, product
from model_service.model.packed import PackedWeight
from model_service.model.moe import (
    ExpertWeights,
    Routing,
    experts_by_cond,
    grouped_experts,
    pick_tile,
)

rng = np.random.default_rng(0)


def _prompt(n: int, vocab: int = 64) -> np.ndarray:
    return rng.integers(3, vocab, n).astype(np.int32)


def _prefix(tiny, prompt: np.ndarray, bucket: int = 16):
    toks = np.zeros((1, bucket), np.int32)
    toks[0, : len(prompt)] = prompt
    return tiny.prefill(tiny.params, jnp.asarray(toks), jnp.int32(len(prompt)))


def _slot_kv(tiny, memory, layer: int, slot: int, which: str = "k") -> np.ndarray:
    """[Hkv, S, D]: the positions `slot` holds in layer `layer`'s pool (dense tables)."""
    table = tiny.model.dense_tables(memory.positions.shape[0])[slot:slot + 1]
    pool = getattr(memory.layers[layer], which)
    return np.asarray(gather(pool, jnp.asarray(table)))[0, :, :tiny.cfg.sequence_len]


def test_decode_continues_a_prefill_exactly_like_a_full_forward_pass(tiny) -> None:
    seq = _prompt(12)
    full = np.asarray(tiny.forward(tiny.params, jnp.asarray(seq[None])))[0]
    logits, prefix = _prefix(tiny, seq[:5])
    np.testing.assert_allclose(np.asarray(logits)[0], full[4], atol=1e-4)
    memory = tiny.insert(tiny.model.init_memory(2), prefix, jnp.int32(1))
    for i in range(5, 12):
        step, memory = tiny.decode(tiny.params, jnp.asarray([7, seq[i]], jnp.int32), memory)
        np.testing.assert_allclose(np.asarray(step)[1], full[i], atol=1e-4)
    assert np.asarray(memory.positions)[1] == 12


def test_slots_decode_at_their_own_positions_independently(tiny) -> None:
    a, b = _prompt(4), _prompt(9)
    (_, pa), (_, pb) = _prefix(tiny, a), _prefix(tiny, b)
    batch = tiny.insert(tiny.insert(tiny.model.init_memory(3), pa, jnp.int32(0)), pb, jnp.int32(2))
    alone = tiny.insert(tiny.model.init_memory(3), pa, jnp.int32(0))
    for tok in (5, 6, 7):
        lb, batch = tiny.decode(tiny.params, jnp.asarray([tok, 9, tok + 1], jnp.int32), batch)
        la, alone = tiny.decode(tiny.params, jnp.asarray([tok, 3, 3], jnp.int32), alone)
        np.testing.assert_allclose(np.asarray(lb)[0], np.asarray(la)[0], atol=1e-5)
    assert list(np.asarray(batch.positions)) == [7, 3, 12]


def test_a_slot_at_the_end_of_memory_clamps_and_leaves_other_slots_untouched(tiny) -> None:
    s = tiny.cfg.sequence_len
    _, prefix = _prefix(tiny, _prompt(s), bucket=s)
    memory = tiny.insert(tiny.model.init_memory(2), prefix, jnp.int32(0))
    other_k = _slot_kv(tiny, memory, 0, 1)  # [H, S, D]
    for _ in range(3):
        logits, memory = tiny.decode(tiny.params, jnp.asarray([4, 5], jnp.int32), memory)
        assert np.isfinite(np.asarray(logits)).all()
    assert list(np.asarray(memory.positions)) == [s, 3]
    assert not np.array_equal(_slot_kv(tiny, memory, 0, 1), other_k)  # slot 1 wrote its own rows 0..2
    np.testing.assert_array_equal(_slot_kv(tiny, memory, 0, 1)[:, 3:], other_k[:, 3:])


def test_insert_resets_the_slot_position_and_copies_the_prefix(tiny) -> None:
    _, long_prefix = _prefix(tiny, _prompt(11))
    _, short_prefix = _prefix(tiny, _prompt(3))
    memory = tiny.insert(tiny.model.init_memory(2), long_prefix, jnp.int32(1))
    _, memory = tiny.decode(tiny.params, jnp.asarray([4, 5], jnp.int32), memory)
    memory = tiny.insert(memory, short_prefix, jnp.int32(1))
    assert list(np.asarray(memory.positions)) == [1, 3]
    np.testing.assert_array_equal(_slot_kv(tiny, memory, 1, 1, "v")[:, :16], np.asarray(short_prefix.layers[1].v[0]))


def test_pad_tokens_in_a_prompt_are_masked_as_keys(tiny) -> None:
    prompt = _prompt(8)
    prompt[3] = tiny.cfg.pad_token
    base, _ = _prefix(tiny, prompt)
    params = jax.tree.map(lambda x: x, tiny.params)
    table, pad = params["language_model/in_out_embed"]["embeddings"], tiny.cfg.pad_token
    if isinstance(table, PackedWeight):  # native products: the table is packed [V/16, D, 16]
        table = dataclasses.replace(table, packed=table.packed.at[pad // 16, :, pad % 16].set(5.0))
    else:
        table = table.at[pad].set(5.0)
    params["language_model/in_out_embed"] = {"embeddings": table}
    toks = np.zeros((1, 16), np.int32)
    toks[0, :8] = prompt
    changed, _ = tiny.prefill(params, jnp.asarray(toks), jnp.int32(8))
    # the table is tied, so only the pad id's own logit may move
    np.testing.assert_allclose(np.asarray(changed)[:, 1:], np.asarray(base)[:, 1:], atol=1e-5)
    # the pad position is not simply ignored: putting a real token there changes the output
    toks[0, 3] = 1
    other, _ = tiny.prefill(tiny.params, jnp.asarray(toks), jnp.int32(8))
    assert not np.allclose(np.asarray(other)[:, 1:], np.asarray(base)[:, 1:], atol=1e-3)


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


def test_decode_with_free_slots_leaves_active_slots_bit_identical(tiny) -> None:
    _, prefix = _prefix(tiny, _prompt(6))
    memory = tiny.model.init_memory(4)
    for slot in range(4):
        memory = tiny.insert(memory, prefix, jnp.int32(slot))
    tokens = jnp.asarray([5, 9, 11, 13], jnp.int32)
    all_logits, all_memory = tiny.decode(tiny.params, tokens, memory)
    active = jnp.asarray([True, False, True, False])
    some_logits, some_memory = tiny.decode(tiny.params, tokens, memory, None, active)
    np.testing.assert_array_equal(np.asarray(some_logits)[[0, 2]], np.asarray(all_logits)[[0, 2]])
    for layer in range(len(memory.layers)):
        for slot in (0, 2):
            np.testing.assert_array_equal(_slot_kv(tiny, all_memory, layer, slot), _slot_kv(tiny, some_memory, layer, slot))
        # a free slot writes nothing
        np.testing.assert_array_equal(_slot_kv(tiny, some_memory, layer, 1), _slot_kv(tiny, memory, layer, 1))
    np.testing.assert_array_equal(np.asarray(some_memory.positions), np.asarray(all_memory.positions))


def _numpy_dequantised(weight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The checkpoint's [K, N] matrix in float64: each int8 entry times its block's scale, computed
    independently of model_service (row block b covers rows b*K/blocks .. (b+1)*K/blocks - 1)."""
    k, _ = weight.shape
    block_of_row = np.arange(k) // (k // scales.shape[0])
    return weight.astype(np.float64) * scales.astype(np.float64)[block_of_row, :]


@pytest.mark.parametrize("products", list(Products))
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
def test_a_decode_row_is_bit_identical_whatever_number_of_tiles_runs(golden_model, products: Products) -> None:
    from model_service.model import GrokModel

    loaded = golden_model("1,1", "float32")
    model = GrokModel(loaded.cfg, loaded.model.mesh, jnp.float32, products)
    slots, tile = 8, 2
    prompts = [_prompt(n, loaded.cfg.vocab_size) for n in (5, 11, 3, 14, 7, 9, 2, 12)]
    toks = np.zeros((slots, 16), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    _, prefix = jax.jit(model.prefill)(loaded.params, jnp.asarray(toks), jnp.asarray([len(p) for p in prompts]))
    memory = model.init_memory(slots)
    for slot in range(slots):
        memory = jax.jit(model.insert)(memory, prefix, jnp.int32(slot), row=jnp.int32(slot))
    tokens = jnp.asarray(rng.integers(3, loaded.cfg.vocab_size, slots), jnp.int32)
    decode = jax.jit(model.decode, static_argnums=5)  # one program: the number of tiles that run is traced
    active = jnp.asarray([True, True, False, True, True, False, True, True])
    results = {}
    for r in (2, 4, 6, 8):
        logits, mem = decode(loaded.params, tokens, memory, None, active, tile, jnp.int32(r // tile))
        results[r] = (logits[:r], mem)
    view = lambda mem, slot: _slot_kv(loaded, mem, 1, slot)  # noqa: E731
    for r, (logits, mem) in results.items():
        for row in np.flatnonzero(np.asarray(active[:r])):
            np.testing.assert_array_equal(np.asarray(logits)[row], np.asarray(results[8][0])[row], err_msg=f"{r}/{row}")
            np.testing.assert_array_equal(view(mem, row), view(results[8][1], row))
        # slots beyond the computed rows are left as they were
        for slot in range(r, slots):
            np.testing.assert_array_equal(view(mem, slot), view(memory, slot))
        assert list(np.asarray(mem.positions)) == [len(p) + (i < r) for i, p in enumerate(prompts)]


def test_a_prefilled_prompt_is_bit_identical_alone_or_with_others(golden_model) -> None:
    loaded = golden_model("1,1", "float32")
    prompts = [_prompt(n, loaded.cfg.vocab_size) for n in (5, 11, 3, 14)]
    toks = np.zeros((4, 16), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    together, prefix = loaded.prefill(loaded.params, jnp.asarray(toks), lengths)
    for i in range(4):
        alone, one = loaded.prefill(loaded.params, jnp.asarray(toks[i:i + 1]), lengths[i:i + 1])
        np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(together)[i])
        np.testing.assert_array_equal(np.asarray(one.layers[0].v)[0], np.asarray(prefix.layers[0].v)[i])


def test_a_prompt_prefilled_in_chunks_matches_a_prefill_at_once(tiny) -> None:
    from model_service.model import GrokModel

    prompt = _prompt(14)
    logits, prefix = _prefix(tiny, prompt)
    m = tiny.model
    model = GrokModel(m.cfg, m.mesh, m.dtype, m.products, block_size=4)  # chunks of 4 = one block each
    memory = model.init_memory(2)
    table = jnp.asarray(model.dense_tables(2)[1])
    extend = jax.jit(model.extend)
    chunk = np.zeros((1, 16), np.int32)
    chunk[0, :14] = prompt
    for start in (0, 4, 8, 12):
        last = min(3, 13 - start)
        out, memory = extend(tiny.params, jnp.asarray(chunk[:, start:start + 4]), memory, table, jnp.int32(1),
                             jnp.int32(start), jnp.int32(last))
    np.testing.assert_allclose(np.asarray(out), np.asarray(logits), atol=1e-5)
    held = np.asarray(gather(memory.layers[1].k, table[None]))[0]
    np.testing.assert_allclose(held[:, :14], np.asarray(prefix.layers[1].k[0, :, :14]), atol=1e-5)
    assert list(np.asarray(memory.positions)) == [0, 14]
