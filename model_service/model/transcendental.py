"""float32's transcendental functions at the accuracy the faithful mode needs.

A TPU's float32 `tanh`, `exp` and `log` are fast approximations: measured on a v5e (JAX 0.10.2, against float64) up
to 1,287 ulps for tanh (7.8e-5 relative), 2,552 for log and 71 for exp, where a CPU's are within 5 ulps. Grok's
attention caps every score with 30·tanh(x/30) and its experts' gelu is tanh's too, so the float32 logits came out
~1e-3 from the reference's, enough to flip a router's near-tie on the golden checkpoint's 64-token prompt (a
perturbation of 1e-5 of the weights flips the same decision on a CPU). `accurate()`, entered by
GrokModel.precision for Products.EXACT (float32 on a TPU), makes the functions below ask XLA for its most accurate
forms (`accuracy=HIGHEST`) while a program is traced; elsewhere they are jax.numpy's and jax.nn's own, bit for
bit (the CPU's parity and the bfloat16 programs do not change).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_ACCURATE: contextvars.ContextVar[bool] = contextvars.ContextVar("accurate_transcendentals", default=False)
HIGHEST = jax.lax.AccuracyMode.HIGHEST


@contextlib.contextmanager
def accurate() -> Iterator[None]:
    """While tracing under it, the functions below take XLA's most accurate forms."""
    token = _ACCURATE.set(True)
    try:
        yield
    finally:
        _ACCURATE.reset(token)


def is_accurate() -> bool:
    return _ACCURATE.get()


def tanh(x: Array) -> Array:
    return jax.lax.tanh(x, accuracy=HIGHEST) if _ACCURATE.get() else jnp.tanh(x)


def exp(x: Array) -> Array:
    return jax.lax.exp(x, accuracy=HIGHEST) if _ACCURATE.get() else jnp.exp(x)


def gelu(x: Array) -> Array:
    """jax.nn.gelu's tanh form (the reference's), its tanh accurate when asked."""
    if not _ACCURATE.get():
        return jax.nn.gelu(x)
    c = np.sqrt(2 / np.pi).astype(x.dtype)
    return x * (0.5 * (1.0 + tanh(c * (x + 0.044715 * (x ** 3)))))


def softmax(x: Array, axis: int = -1) -> Array:
    if not _ACCURATE.get():
        return jax.nn.softmax(x, axis=axis)
    e = exp(x - jnp.max(x, axis=axis, keepdims=True))
    return e / jnp.sum(e, axis=axis, keepdims=True)


def log_softmax(x: Array, axis: int = -1) -> Array:
    if not _ACCURATE.get():
        return jax.nn.log_softmax(x, axis=axis)
    shifted = x - jnp.max(x, axis=axis, keepdims=True)
    return shifted - jax.lax.log(jnp.sum(exp(shifted), axis=axis, keepdims=True), accuracy=HIGHEST)


def inverse_frequencies(base: float, dim: int) -> Array:
    """RoPE's 1 / base^(2i / dim) [dim / 2] in float32: jax.numpy's power, or (accurate) computed in float64 on the
    host and rounded once."""
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32)
    if not _ACCURATE.get():
        return 1.0 / (base ** (exponents / dim))
    e = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)  # float32, as jax.numpy's form rounds it
    power = (float(base) ** e.astype(np.float64)).astype(np.float32)
    return jnp.asarray(np.float32(1.0) / power)
