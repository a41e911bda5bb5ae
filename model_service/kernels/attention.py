"""Native CPU paged attention (native/attention.cc) called from JAX through XLA's FFI: one query token per row,
each row attending to its own sequence's keys in the KV block pool.

This is the kernel the one-step engine calls for every row of a step (prompt tokens and decode tokens alike).
Its point is row invariance by construction: a row's output bits depend only on its own query, its own
sequence's keys and values at positions 0..limit and the multiplier, never on the step's other rows, the mask,
their order, how rows of one sequence are grouped or the thread count. Rows of one sequence share each key and
value load, so a prompt chunk costs little more than its arithmetic. The instruction set is chosen as for the
matmul kernel (GROK_KERNEL_ISA; `isa` overrides it); the three paths compute the same operations in the same
order, so they agree bit for bit too.

The XLA fallback stays in model_service/model/layers.py (`paged_attention_rows`); this module only raises when
the extension is missing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model_service import kernels

MATH_FNS = {"exp": 0, "cap": 1}


def available() -> bool:
    """True when the native extension loaded (and GROK_KERNEL_ISA is not 'off')."""
    return kernels.available()


def _require() -> None:
    if not available():
        raise RuntimeError("native paged attention is not available: the extension model_service.kernels._native is "
                           "missing or disabled (GROK_KERNEL_ISA=off); rebuild with `pip install -e .` or use "
                           "layers.paged_attention_rows")


def _isa_attr(isa: str | None) -> np.int64:
    isa = isa or kernels.default_isa()
    if isa not in kernels.ISAS:
        raise ValueError(f"isa must be one of {sorted(kernels.ISAS)}, got {isa!r}")
    if isa != "auto" and isa not in kernels.supported_isas():
        raise ValueError(f"isa {isa!r} is not supported on this CPU (supported: {kernels.supported_isas()})")
    return np.int64(kernels.ISAS[isa])


def _check(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, tables: jax.Array, seq: jax.Array,
           limit: jax.Array, rows: jax.Array) -> None:
    if q.ndim != 3:
        raise ValueError(f"paged_attention: q must be [R, Hq, D], got {q.shape}")
    if pool_k.ndim != 4 or pool_k.shape != pool_v.shape:
        raise ValueError(f"paged_attention: pool_k and pool_v must both be [NBLK, Hkv, BS, D], got {pool_k.shape} "
                         f"and {pool_v.shape}")
    if pool_k.dtype != pool_v.dtype or pool_k.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"paged_attention: the pools must both be float32 or both bfloat16, got {pool_k.dtype} "
                         f"and {pool_v.dtype}")
    r, hq, d = q.shape
    hkv = pool_k.shape[1]
    if pool_k.shape[3] != d or hq % hkv:
        raise ValueError(f"paged_attention: q [R, Hq={hq}, D={d}] does not fit pools with Hkv={hkv}, "
                         f"D={pool_k.shape[3]} (Hq must be a multiple of Hkv)")
    if tables.ndim != 2:
        raise ValueError(f"paged_attention: tables must be [S, L], got {tables.shape}")
    for name, a in (("seq", seq), ("limit", limit), ("rows", rows)):
        if a.shape != (r,):
            raise ValueError(f"paged_attention: {name} must be [R={r}], got {a.shape}")


def paged_attention(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, tables: jax.Array, seq: jax.Array,
                    limit: jax.Array, rows: jax.Array, multiplier: float, isa: str | None = None,
                    threads: int = 0) -> jax.Array:
    """Attention of one query token per row over the paged pool -> float32 [R, Hq * D] (head-major, as
    layers.attention returns it).

    q float32 [R, Hq, D]; pool_k, pool_v [NBLK, Hkv, BS, D] float32 or bfloat16 (widened exactly);
    tables int32 [S, L]: sequence s's position p is at block tables[s, p // BS], offset p % BS;
    seq int32 [R]: each row's sequence; limit int32 [R]: row r sees key positions 0..limit[r];
    rows bool [R]: the rows to compute (the others come out zero and cost nothing).
    Query head h reads kv head h // (Hq / Hkv); scores are (q . k) * multiplier capped to 30 tanh(s / 30),
    soft-maxed over the visible keys in float32 and used to weight the values (as layers.attention).

    A computed row needs 0 <= seq < S, 0 <= limit < L * BS and valid blocks up to its limit: a row with
    limit < 0 sees no key and is not valid input (leave it unmarked). Violations raise when the call runs.
    `threads` 0 uses XLA's intra-op pool; `isa` None takes GROK_KERNEL_ISA or the fastest path. Works inside
    jit; under vmap each batch element is its own call.
    """
    _require()
    _check(q, pool_k, pool_v, tables, seq, limit, rows)
    r, hq, d = q.shape
    out = jax.ShapeDtypeStruct((r, hq * d), jnp.float32)
    call = jax.ffi.ffi_call("grok_paged_attention", out, vmap_method="sequential")
    return call(q.astype(jnp.float32), pool_k, pool_v, tables.astype(jnp.int32), seq.astype(jnp.int32),
                limit.astype(jnp.int32), rows.astype(jnp.bool_), multiplier=np.float32(multiplier),
                isa=_isa_attr(isa), threads=np.int64(threads))


def math(x: jax.Array, fn: str, isa: str | None = None) -> jax.Array:
    """The kernel's vectorised exp ('exp') or logit cap 30 tanh(x / 30) ('cap') on float32 x (any shape), as
    the attention computes them: for accuracy tests and benchmarks."""
    _require()
    if fn not in MATH_FNS:
        raise ValueError(f"fn must be one of {sorted(MATH_FNS)}, got {fn!r}")
    x = jnp.asarray(x, jnp.float32)
    flat = x.reshape(-1)
    call = jax.ffi.ffi_call("grok_attention_math", jax.ShapeDtypeStruct(flat.shape, jnp.float32),
                            vmap_method="broadcast_all")
    return call(flat, fn=np.int64(MATH_FNS[fn]), isa=_isa_attr(isa)).reshape(x.shape)
