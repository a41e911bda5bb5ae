"""A step's draws reach the host as one array (engine_state.pack_draws): every field arrives as it left the
device, the probabilities bit for bit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from model_service.engine_state import PendingStep, pack_draws, unpack_draws
from model_service.sampling import SampleResult


def test_every_field_of_the_draws_arrives_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    p, k = 7, 5
    probs = rng.random(p).astype(np.float32)
    probs[:4] = [-0.0, np.float32(1e-45), np.inf, np.nan]  # signed zero, a denormal, and what a bad row may carry
    top = rng.random((p, k)).astype(np.float32)
    top[0, 0] = np.float32(np.nextafter(np.float32(1), np.float32(0)))
    result = SampleResult(jnp.asarray(rng.integers(0, 131072, p), jnp.int32), jnp.asarray(probs),
                          jnp.asarray(rng.integers(0, 131072, (p, k)), jnp.int32), jnp.asarray(top),
                          jnp.asarray([True, False] * 3 + [True]))
    accepted = jnp.asarray([False, True] * 3 + [True])
    packed = pack_draws(result, accepted)
    assert packed.dtype == jnp.int32 and packed.shape == (p, 4 + 2 * k)
    token, prob, top_ids, top_probs, bad, acc = unpack_draws(np.asarray(packed))
    np.testing.assert_array_equal(token, np.asarray(result.token))
    np.testing.assert_array_equal(prob.view(np.uint32), probs.view(np.uint32))
    np.testing.assert_array_equal(top_ids, np.asarray(result.top_ids))
    np.testing.assert_array_equal(top_probs.view(np.uint32), top.view(np.uint32))
    np.testing.assert_array_equal(bad, np.asarray(result.bad))
    np.testing.assert_array_equal(acc, np.asarray(accepted))
    assert (prob.dtype, top_probs.dtype, bad.dtype, acc.dtype) == (np.float32, np.float32, np.bool_, np.bool_)
    out = PendingStep(packed, None).get()
    np.testing.assert_array_equal(out.prob.view(np.uint32), probs.view(np.uint32))
    assert out.logprob is None and out.accepted.tolist() == np.asarray(accepted).tolist()
